"""`kvserve` command line: one subcommand per job, each implemented in its own package.

Every subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int | None``;
they are imported lazily so `kvserve route` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvserve.server.cli", "OpenAI-compatible server of one engine"),
    "route": ("kvserve.cluster.cli", "KV-aware router / OpenAI-compatible gateway"),
    "up": ("kvserve.bench.up", "start a local cluster (router + engines) and serve"),
    "demo": ("kvserve.bench.demo", "run the README demo on the embedded tiny model"),
    "bench": ("kvserve.bench.cli", "benchmarks and workloads"),
    "sim": ("kvserve.sim.cli", "simulated engine(s) with a latency model"),
    "make-model": ("kvserve.model.presets", "write a deterministic local HF-format model"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only import the module of the chosen subcommand (keeps `--help` and `route` light).
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, (mod_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            modules[name] = importlib.import_module(mod_name)
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    rc = modules[args.command].run(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())

"""KV index: blocks in a shared storage tier count for every endpoint that can load them."""

from __future__ import annotations

from kvserve.cluster.kv_index import DEFAULT_TIER_WEIGHTS, KVIndex, medium_bit
from kvserve.engine.hashing import hash_block_tokens, hash_to_int
from kvserve.kv.events import BlockRemoved
from tests.cluster.test_kv_index import BS, stored

TIER = "fs:/mnt/kv"


def keys(tokens: list[int]) -> list[int]:
    return [hash_to_int(h) for h in hash_block_tokens(tokens, BS)]


def shared(tokens, hashes, parent=None, tier=TIER) -> object:
    return stored(tokens, hashes, parent, medium="STORAGE", tier=tier, shared=True,
                  locality="LOCAL")  # fmt: skip


def test_storage_medium_is_told_apart_by_tier() -> None:
    assert medium_bit("STORAGE", "disk") == medium_bit("DISK")
    assert medium_bit("STORAGE", "fs:/x") == medium_bit("FS")
    assert medium_bit("STORAGE", "redis://h:6379/0") == medium_bit("REDIS")
    assert medium_bit("STORAGE", None) == medium_bit("SOMETHING-ELSE")


def test_shared_tier_block_counts_for_every_member_at_its_weight() -> None:
    idx = KVIndex()
    tokens = list(range(1, 4 * BS + 1))
    ours = keys(tokens)
    fs_w = DEFAULT_TIER_WEIGHTS["FS"]
    # b has used the tier (it published a block of its own there); a writes the prefix.
    idx.apply_events("b", [shared([7] * BS, [900])])
    idx.apply_events("c", [stored(tokens[:BS], [1])])  # c: GPU only, never used the tier
    idx.apply_events("a", [stored(tokens, [11, 12, 13, 14])])
    idx.apply_events("a", [shared(tokens[: 3 * BS], [11, 12, 13])])
    assert set(idx.tier_members(TIER)) == {"a", "b"}
    got = idx.match_endpoints(["a", "b", "c"], lambda bs: ours)
    assert got["a"][:2] == (4, 4.0)  # a holds all on GPU
    assert got["b"][0] == 3 and abs(got["b"][1] - 3 * fs_w) < 1e-9  # through the tier
    assert got["c"][:2] == (1, 1.0)  # not a member: only its own block
    # Configured membership counts like learned membership.
    idx.add_tier_member("c", TIER)
    assert idx.match_endpoints(["c"], lambda bs: ours)["c"][0] == 3
    # The publisher clearing (restart) does not empty the shared tier...
    idx.clear_endpoint("a")
    assert idx.match_endpoints(["b"], lambda bs: ours)["b"][0] == 3
    # ...a removal from the tier does (block 1 gone: the run ends at 1 block).
    idx.apply_events("b", [BlockRemoved(block_hashes=[12], medium="STORAGE", tier=TIER,
                                        shared=True)])  # fmt: skip
    assert idx.match_endpoints(["b"], lambda bs: ours)["b"][0] == 1
    idx.remove_endpoint("b")
    assert set(idx.tier_members(TIER)) == {"a", "c"}


def test_private_storage_tier_is_not_shared() -> None:
    idx = KVIndex()
    tokens = list(range(1, 2 * BS + 1))
    idx.apply_events("b", [shared([7] * BS, [900])])
    idx.apply_events("a", [stored(tokens, [1, 2], medium="STORAGE", tier="disk", locality="LOCAL")])
    got = idx.match_endpoints(["a", "b"], lambda bs: keys(tokens))
    assert got["a"][0] == 2 and abs(got["a"][1] - 2 * DEFAULT_TIER_WEIGHTS["DISK"]) < 1e-9
    assert got["b"][0] == 0


def test_endpoint_flag_names_shared_tiers() -> None:
    from kvserve.cluster.cli import parse_endpoint_flag

    spec = parse_endpoint_flag("http://127.0.0.1:8000,tier=fs:/mnt/kv,tier=redis://h:6379/0")
    assert spec.shared_tiers == ["fs:/mnt/kv", "redis://h:6379/0"]

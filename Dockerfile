# kvserve, CPU build: `docker build -t kvserve:0.1.0 .` (the image deploy/ refers to).
# The entry point is the `kvserve` command: `docker run kvserve:0.1.0 serve --model ...`.
# For a CUDA build, pass --build-arg TORCH_INDEX_URL=<a CUDA wheel index> (and a CUDA base).

FROM python:3.11-slim AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# The wheel with its two optional C extensions (streaming block copies, paged attention).
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# libgomp1: the paged-attention kernel's OpenMP runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
# torch first, pinned, from the CPU index (a bare `torch` from PyPI pulls the CUDA wheels)
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==2.13.0"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
RUN useradd --uid 10001 --create-home kvserve \
    && mkdir -p /models /var/lib/kvserve && chown kvserve /models /var/lib/kvserve
USER 10001
EXPOSE 8000 5557 5558
ENTRYPOINT ["kvserve"]
CMD ["--help"]

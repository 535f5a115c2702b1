# The init-container image: kcache without torch. `kcache restore` never imports torch, so the
# image stays small and starts fast; the model container brings its own torch.
#
# Reproducible: every dependency comes from constraints/image.txt (pinned, with hashes; pip refuses
# anything else), the build backend from constraints/build.txt, the base image from a pinned tag
# (pin it by digest in production). No `gpu` extra: this image never sees a GPU, it reads the model
# container's facts (--facts-file). Regenerate the constraints after changing pyproject.toml:
#   pip-compile --generate-hashes --allow-unsafe --strip-extras --extra postgres \
#     --no-emit-index-url --no-emit-find-links -o constraints/image.txt pyproject.toml
#   pip-compile --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
#     --no-emit-find-links -o constraints/build.txt constraints/build.in
#
# Layers: the dependencies stage sees only the constraints file, so a change to kcache's source
# rebuilds the wheel and the last layer, never the dependencies. The `kcache proxy` sidecar needs
# the `proxy` extra (aiohttp, redis) on top: build it from its own constraints, not this image.
#   docker build --build-arg KCACHE_COMMIT=$(git describe --always --dirty) -t kcache:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY constraints/image.txt /tmp/image.txt
RUN python -m venv /opt/kcache \
 && /opt/kcache/bin/pip install --no-deps --require-hashes --only-binary=:all: -r /tmp/image.txt

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY constraints/build.txt /tmp/build.txt
RUN python -m venv /opt/build && /opt/build/bin/pip install --no-deps --require-hashes -r /tmp/build.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kcache ./kcache
COPY migrations ./migrations
# `kcache --version` names this commit; from a checkout without the file it asks git.
ARG KCACHE_COMMIT=unknown
RUN printf '%s\n' "$KCACHE_COMMIT" > kcache/_commit.txt \
 && /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# The `kcache proxy` sidecar (examples/k8s/proxy-sidecar.yaml): the same kcache plus the `proxy`
# extra (aiohttp, redis), which the init image never carries. Its two packages come from PyPI within
# pyproject's bounds, not from the hashed lock:
#   docker build --target proxy -t kcache-proxy:0.1.0 .
FROM ${PYTHON_IMAGE} AS proxy
COPY --from=deps /opt/kcache /opt/kcache
COPY --from=build /wheels /wheels
RUN /opt/kcache/bin/pip install --no-cache-dir --no-deps --no-index /wheels/kcache-*.whl && rm -rf /wheels \
 && /opt/kcache/bin/pip install --no-cache-dir "aiohttp>=3.9,<4" "redis>=5.0,<9"
ENV PATH=/opt/kcache/bin:$PATH
USER 65532:65532
ENTRYPOINT ["kcache"]
CMD ["proxy", "--help"]

# The init-container image (the default target).
FROM ${PYTHON_IMAGE}
COPY --from=deps /opt/kcache /opt/kcache
COPY --from=build /wheels /wheels
RUN /opt/kcache/bin/pip install --no-cache-dir --no-deps --no-index /wheels/kcache-*.whl && rm -rf /wheels
ENV PATH=/opt/kcache/bin:$PATH
# Any non-root user: restore writes only under --into and never needs root. KCACHE_HOME under /tmp,
# which the examples mount as an emptyDir (the root filesystem is read-only there).
USER 65532:65532
ENV KCACHE_HOME=/tmp/kcache
ENTRYPOINT ["kcache"]
CMD ["--help"]

# The init-container image: kcache without torch. `kcache restore` never imports torch, so the
# image stays small and starts fast; the model container brings its own torch.
FROM python:3.11-slim AS build
# The proxy sidecar's image adds `proxy` (aiohttp, redis): --build-arg KCACHE_EXTRAS=postgres,gpu,proxy
ARG KCACHE_EXTRAS=postgres,gpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kcache ./kcache
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[${KCACHE_EXTRAS}]"

FROM python:3.11-slim
ARG KCACHE_EXTRAS=postgres,gpu
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "kcache[${KCACHE_EXTRAS}]" && rm -rf /wheels
# Any non-root user: restore writes only under --into and never needs root.
USER 65532:65532
ENV KCACHE_HOME=/tmp/kcache
ENTRYPOINT ["kcache"]
CMD ["--help"]

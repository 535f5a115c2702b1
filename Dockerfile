# The init-container image: kcache without torch. `kcache restore` never imports torch, so the
# image stays small and starts fast; the model container brings its own torch.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kcache ./kcache
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[postgres,gpu]'

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'kcache[postgres,gpu]' && rm -rf /wheels
# Any non-root user: restore writes only under --into and never needs root.
USER 65532:65532
ENV KCACHE_HOME=/tmp/kcache
ENTRYPOINT ["kcache"]
CMD ["--help"]

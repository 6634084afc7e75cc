# timeoutd container image.
#
#   docker build -t timeoutd \
#     --build-arg REVISION="$(git rev-parse HEAD)" \
#     --build-arg VERSION="$(cargo pkgid | cut -d'#' -f2)" \
#     --build-arg SOURCE=https://github.com/OWNER/timeoutd .
#   docker run --rm -p 9464:9464 \
#     -e TIMEOUTD_MONGODB__URI=mongodb://mongo:27017 \
#     -e TIMEOUTD_RABBITMQ__URI=amqp://user:pass@rabbit:5672/%2f \
#     timeoutd
#
# The build context has no .git (.dockerignore), so the commit comes in as the REVISION build
# arg: build.rs reads it as TIMEOUTD_GIT_REVISION (`timeoutd --version`, the start-up log
# line, timeoutd_build_info{revision}); without it the binary says `unknown`. The same args
# become the image's OCI labels.
#
# The build needs only what the Rust image has: rustls uses aws-lc-sys, which is compiled
# with the C compiler (its cc builder; no cmake, perl, go or clang). The runtime image is
# distroless (glibc, libgcc, CA certificates; no shell), so HEALTHCHECK is in exec form.

FROM rust:1.95.0-slim-bookworm AS build
WORKDIR /build
ENV CARGO_TERM_COLOR=never \
    CARGO_PROFILE_RELEASE_STRIP=symbols

# Dependencies first, against placeholder sources: this layer is rebuilt only when
# Cargo.toml or Cargo.lock change, not on every source edit.
COPY Cargo.toml Cargo.lock build.rs ./
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src

# After the dependency layer, so that a new commit does not rebuild the dependencies.
ARG REVISION=unknown
ENV TIMEOUTD_GIT_REVISION=${REVISION}
# The real sources. touch: COPY keeps the files' own times, which can be older than the
# placeholder build, and cargo would then keep the placeholder binary.
COPY src ./src
COPY config/timeoutd.toml ./config/timeoutd.toml
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked --bin timeoutd \
    && ./target/release/timeoutd --config config/timeoutd.toml check-config > /dev/null

FROM gcr.io/distroless/cc-debian12:nonroot
ARG REVISION=unknown
ARG VERSION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="timeoutd" \
      org.opencontainers.image.description="Fires ServiceConnect timeouts from MongoDB to RabbitMQ" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE}"
COPY --from=build /build/target/release/timeoutd /usr/local/bin/timeoutd
COPY config/timeoutd.toml /etc/timeoutd/timeoutd.toml
# distroless's "nonroot" user, by number so that Kubernetes' runAsNonRoot can check it.
USER 65532:65532
WORKDIR /
# [http] listen: /metrics, /healthz, /readyz.
EXPOSE 9464
# On SIGTERM timeoutd stops claiming, waits up to [dispatch] shutdown_timeout (20s) for
# publish confirms and 5s more for releases: give `docker stop` --time 30 or more.
STOPSIGNAL SIGTERM
# `timeoutd health` GETs /healthz on [http] listen and gives up after 5s.
HEALTHCHECK --interval=15s --timeout=10s --start-period=30s --retries=3 \
    CMD ["timeoutd", "health"]
ENTRYPOINT ["timeoutd", "run"]

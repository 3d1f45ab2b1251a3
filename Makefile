# Palisade. `make run` and `make test` each work as the first command on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard proto/palisade/v1/*.proto)
PROTO_OUT := $(patsubst proto/%.proto,%_pb2.py,$(PROTOS))
PYTEST_ARGS ?=
# Two pytest workers: one runs every test that needs the kernel (root) in turn, the other the rest
# beside it (tests/conftest.py groups them).
PYTEST_WORKERS ?= 2

.PHONY: setup proto run test lint fmt bench image clean

setup:
	@bash scripts/setup.sh

# Generated code lives in palisade/v1 (not committed): `make proto` after editing a .proto.
proto: $(PROTO_OUT)

palisade/v1/%_pb2.py: proto/palisade/v1/%.proto $(PROTOS)
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m grpc_tools.protoc -I proto \
		--python_out=. --grpc_python_out=. --mypy_out=quiet:. --mypy_grpc_out=quiet:. $(PROTOS)
	@touch palisade/v1/*_pb2.py

run: setup
	@$(PY) -m services.devstack $(RUN_ARGS)

test: setup
	@$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy
	@$(VENV)/bin/lint-imports

fmt: setup
	@$(VENV)/bin/ruff format .
	@$(VENV)/bin/ruff check --fix .

# The container image palisade:dev (deploy/docker/Dockerfile), on the public base where it can be
# pulled and on a local Debian base otherwise; see deploy/README.md. IMAGE_ARGS: scripts/image.sh's.
image: setup
	@bash scripts/image.sh $(IMAGE_ARGS)

bench: setup
	@$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) palisade/v1/*_pb2*.py palisade/v1/*_pb2*.pyi .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

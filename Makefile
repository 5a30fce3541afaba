# Unicron: `make demo` runs the whole system on this machine; `make test` checks it.
# Both install what they need: a virtual environment with pinned packages, the generated
# gRPC code, and redis-server from the system's packages when missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GEN_STAMP := unicron/v1/.generated
PROTOS := $(wildcard proto/unicron/v1/*.proto)

.PHONY: all venv gen redis demo certs test test-unit test-cluster lint fmt clean bench-planner bench-detect bench-transition bench-sim bench-load compose-test deploy-lock

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

demo: gen redis
	$(PY) -m unicron_dev.demo

# A development CA, certificates and tokens in run/certs (see README, Security):
# `make certs NODES=n1,n2 USERS=admin:admin,alice HOSTS=myhost`.
NODES ?= $(shell hostname)
USERS ?= admin:admin
HOSTS ?=
certs: gen
	$(PY) -m unicron.cli certs --out run/certs --nodes "$(NODES)" --users "$(USERS)" --hosts "$(HOSTS)"

test: gen redis
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q -ra --durations=15 -m "not cluster"

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

bench-sim: gen
	$(PY) -m bench.sim

bench-load: gen redis
	$(PY) -m bench.load

# The stack of deploy/compose.yaml as containers on this machine, a job healed in it, all
# torn down after (scripts/compose_test.py). Needs root; not part of `make test`.
compose-test: gen
	$(PY) scripts/compose_test.py

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

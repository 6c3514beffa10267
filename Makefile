# rolloutd — `make run` and `make test` do all the set-up on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: setup run test test-fast lint format bench bench-quick example example-agent proto docs clean distclean

$(STAMP): pyproject.toml constraints.txt scripts/setup.sh
	@scripts/setup.sh $(VENV)
	@touch $(STAMP)

setup: $(STAMP)

# make run ARGS="--restore none"   (any flag of `rolloutd serve`)
run: $(STAMP)
	$(VENV)/bin/rolloutd serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not vllm and not process" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	cd proto && ../$(VENV)/bin/buf lint

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

bench-quick: $(STAMP)
	$(PY) benchmarks/run_all.py --quick

EXAMPLE_ARGS ?= --quick
example: $(STAMP)
	$(PY) examples/grpo.py $(EXAMPLE_ARGS)

# episodes of the calculator tool environment on the tiny model, one trajectory with its mask
AGENT_ARGS ?=
example-agent: $(STAMP)
	$(PY) examples/calculator/agent.py $(AGENT_ARGS)

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

docs: $(STAMP)
	$(PY) scripts/gen_docs.py

# clean keeps .venv (a fresh install takes minutes); distclean removes it too.
clean:
	rm -rf .rolloutd .pytest_cache .mypy_cache .ruff_cache

distclean: clean
	rm -rf $(VENV)

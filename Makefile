# The two set-up commands of README.md. Both create .venv when it is missing
# and (re)install when pyproject.toml changed, then do their job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= models/trained/target

.PHONY: run up test venv clean nats-server

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

nats-server:
	@command -v nats-server >/dev/null || test -x /usr/sbin/nats-server || \
		(apt-get update -qq && apt-get install -y -qq nats-server) || \
		(sudo apt-get update -qq && sudo apt-get install -y -qq nats-server)

# The main job: bring the mesh up on the default model (made locally, no
# download), stream one completion of Python code through it, print its trace, stop.
run: venv nats-server
	test -f $(MODEL)/config.json || $(BIN)/infermesh make-model $(MODEL)
	$(BIN)/infermesh up --model $(MODEL) --demo

# The mesh, kept running until Ctrl-C.
up: venv nats-server
	test -f $(MODEL)/config.json || $(BIN)/infermesh make-model $(MODEL)
	$(BIN)/infermesh up --model $(MODEL)

# The tests tier by tier (tests/run_tiers.sh): unit first, failing fast; then parity,
# deploy and gpu; then the mesh tier, in parallel where it is safe.
test: venv nats-server
	PYTHON=$(BIN)/python bash tests/run_tiers.sh

clean:
	rm -rf $(VENV) models

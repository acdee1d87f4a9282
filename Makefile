# The two set-up commands of README.md. Both create .venv when it is missing
# and (re)install when pyproject.toml changed, then do their job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= models/default

.PHONY: run test venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# The main job: offline generation on the default model (made locally, no download).
run: venv
	test -f $(MODEL)/config.json || $(BIN)/infermesh make-model $(MODEL)
	$(BIN)/infermesh generate --model $(MODEL) --chat --max-tokens 32 \
		--prompt "Write a haiku about paged attention." \
		--prompt "What does a KV cache store?"

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) models

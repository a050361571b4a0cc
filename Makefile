# The README's two commands live here. Both install what they need on a fresh Debian machine.
#   make test      unit tests (+ shellcheck, systemd-analyze) — what CI runs
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: test system-deps venv

# shellcheck and systemd-analyze check every rendered script and unit in the tests.
system-deps:
	@command -v shellcheck >/dev/null && command -v systemd-analyze >/dev/null || { \
	  echo "== installing shellcheck and systemd (Debian packages)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck systemd; }

$(VENV)/.installed: pyproject.toml
	@echo "== creating $(VENV) with sparkform and its test dependencies"
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: system-deps venv
	$(PYTHON) -m pytest -q

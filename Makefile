# The README's two commands. Both install what they need on a fresh Debian machine (as root).
#   make sandbox   boot the local sandbox (or keep the one that is up), converge it with inventory/sandbox.py, verify it
#   make test      lint, then the whole test suite, unit and integration (what CI runs)
VENV ?= .venv
PYTHON := $(VENV)/bin/python
SPARKFORM := $(VENV)/bin/sparkform

.PHONY: sandbox sandbox-down test lint system-deps sandbox-deps venv

# Debian packages, without recommends, each only where a command needs it. `make sandbox`:
# debootstrap builds the sandbox's rootfs (checked with Debian's archive keyring), systemd-nspawn
# boots it, ip and nsenter wire and reach it, ssh logs in, curl runs the lines it prints,
# python3-venv makes the venv (a stock Debian's python3 makes none without it). `make test` adds:
# shellcheck and systemd-analyze check rendered files; strace shows which argv a secret-handling
# command exposes; nginx runs the rendered front in the unit tests (the package's service is not
# started here), with its njs module (libnginx-mod-http-js) for the combined port's router; cc
# (with libc6-dev) compiles the NVML stand-in for the GPU report's unit tests; promtool (Debian's
# prometheus) checks the rendered scrape config, alert rules and textfile metrics; tmux is the real
# terminal a Ctrl-C test types into.
SANDBOX_TOOLS := debootstrap systemd-nspawn ip ssh ssh-keygen nsenter curl
SANDBOX_PACKAGES := debootstrap debian-archive-keyring systemd-container iproute2 openssh-client util-linux curl python3-venv
TEST_TOOLS := $(SANDBOX_TOOLS) shellcheck systemd-analyze strace nginx cc promtool tmux
TEST_PACKAGES := $(SANDBOX_PACKAGES) shellcheck systemd strace nginx libnginx-mod-http-js gcc libc6-dev prometheus tmux

# $(call packages,TOOLS,PACKAGES): install PACKAGES when a tool of TOOLS (or python3's venv, or
# nginx's njs module where nginx is asked for) is missing.
define packages
	@missing=$$(for tool in $(1); do command -v $$tool >/dev/null || echo $$tool; done); \
	python3 -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	case " $(2) " in *" libnginx-mod-http-js "*) test -e /usr/lib/nginx/modules/ngx_http_js_module.so || missing="$$missing libnginx-mod-http-js";; esac; \
	if [ -n "$$missing" ]; then \
	  echo "== installing Debian packages for:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(2); \
	fi
endef

sandbox-deps:
	$(call packages,$(SANDBOX_TOOLS),$(SANDBOX_PACKAGES))

system-deps:
	$(call packages,$(TEST_TOOLS),$(TEST_PACKAGES))

# The venv: sparkform with the sandbox's extras (`make sandbox`), or with the test tools too.
$(VENV)/.sandbox: pyproject.toml
	@echo "== creating $(VENV) with sparkform and the sandbox's extras"
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[sandbox]'
	touch $@

$(VENV)/.installed: pyproject.toml
	@echo "== creating $(VENV) with sparkform and its test dependencies"
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@ $(VENV)/.sandbox

venv: $(VENV)/.installed

sandbox: sandbox-deps $(VENV)/.sandbox
	@echo "== sandbox host (first run: builds a Debian rootfs, ~1.5 min, and a wheelhouse of vLLM's CPU build)"
	$(SPARKFORM) sandbox up --keep
	@echo "== converging it with inventory/sandbox.py (first run: the vLLM venv and three engine starts, ~4 min)"
	$(VENV)/bin/pyinfra -y inventory/sandbox.py deploy.py
	@echo "== verifying it"
	$(SPARKFORM) verify inventory/sandbox.py
	@$(SPARKFORM) sandbox status

sandbox-down: $(VENV)/.sandbox
	$(SPARKFORM) sandbox down

# TEST_WORKERS xdist workers, each integration module (or chain of modules sharing a sandbox) on
# one of them, longest first (tests/chains.py); the log ends with the 20 slowest tests, what each
# live test cost, the time per module against its budget (tests/suite_clock.py) and the memory the
# run held. `make test TEST_WORKERS=0` runs it in one process.
# Three on 2 cores: four was slower (engine starts and venv installs are CPU-bound and contend).
# At most TEST_SANDBOXES sandboxes with engines are up at once (the pair's two count; each holds
# 1-3 GiB): the log's "memory" section prints the run's peak, which stays under 12 GiB so that a
# developer's own sandbox fits beside it (tests/suite_memory.py).
# The run's temporary folders are its own (--basetemp), removed at its end: pytest keeps only the
# newest three of /tmp/pytest-of-USER, so another pytest started meanwhile (a developer's unit
# tests) would delete the folders holding this run's ssh sockets.
TEST_WORKERS ?= 3
TEST_SANDBOXES ?= 4
test: system-deps venv lint
	basetemp="$$(mktemp -d -t sparkform-suite-XXXXXX)" && trap 'rm -rf "$$basetemp"' EXIT && \
	SPARKFORM_TEST_SANDBOXES=$(TEST_SANDBOXES) $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=20 --basetemp "$$basetemp"

# ruff's lint rules and format, then mypy over every Python file that ships (the package with its
# host programs, the deploy file, the shipped inventories, bench/): a finding fails `make test`
# before any test runs (pyproject.toml holds both tools' settings).
TYPED := sparkform deploy.py bench inventory/spark.py inventory/sandbox.py inventory/sandbox-pair.py
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(TYPED)

# Set-up and checks. `make demo` installs everything and runs the demo; `make test` installs and runs the tests.
PYTHON ?= python
PIP ?= $(PYTHON) -m pip
# The CPU wheel here; on a GPU cluster `make install TORCH_SPEC=torch==2.13.0` from the CUDA index works the same.
TORCH_SPEC ?= torch==2.13.0
FAIRSEQ_SPEC ?= fairseq-fixed==0.12.3.1
# Known-good versions: every other package at the version the test suite was last run with (docs/development.md).
# `make install CONSTRAINTS=` installs without them: the newest versions pyproject.toml allows.
CONSTRAINTS ?= constraints.txt
CONSTRAIN = $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# apt-get needs root: sudo where this is not root.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# The constraints were resolved on one Python (their first line, `# python X.Y`); pins such as numpy's may not
# exist for another, so say so up front rather than let pip fail on one of them.
CHECK_PYTHON = import sys; f = sys.argv[1]; want = open(f).readline().split()[-1]; \
	have = "%d.%d" % sys.version_info[:2]; \
	sys.exit(0 if want == have else f"{f} holds the versions tested on Python {want}, this is Python {have}: " \
	"install unconstrained with make install CONSTRAINTS=")

.PHONY: install constraints demo test lint bench bench-peers

install:
ifneq ($(CONSTRAINTS),)
	@$(PYTHON) -c '$(CHECK_PYTHON)' $(CONSTRAINTS)
endif
	$(PIP) install $(CONSTRAIN) "$(TORCH_SPEC)"
	$(PIP) install $(CONSTRAIN) -e ".[fairseq,dev]"
	# fairseq-fixed without its dependencies: its torchaudio requirement pulls a CUDA build that breaks
	# transformers (see docs/development.md), and without build isolation so its C++ extensions build against our torch.
	$(PYTHON) -c "import fairseq" 2>/dev/null || \
		$(PIP) install $(CONSTRAIN) --no-deps --no-build-isolation "$(FAIRSEQ_SPEC)"
	# The report's browser tests run Debian's chromium through chromium-driver; installed where missing.
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ $(SUDO) apt-get update -q && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }
	# An editable install compiles nothing, and where PYTHONDONTWRITEBYTECODE is set no run writes a .pyc: every
	# driver and worker would compile the modules it imports again (a regular pip install compiles them).
	$(PYTHON) -m compileall -q sweep workers results headsweep

# Refreshes constraints.txt from the current environment, on purpose: run it in a fresh venv after
# `make install CONSTRAINTS=` and a passing `make test`, and commit the file. torch, fairseq-fixed and
# headsweep itself are left out: TORCH_SPEC and FAIRSEQ_SPEC pin the first two (a CUDA torch is the same pin).
constraints:
	{ echo "# python $$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')"; \
	  echo "# Known-good versions: what the test suite was last run with. Written by make constraints"; \
	  echo "# (docs/development.md); torch and fairseq-fixed are pinned in the Makefile (TORCH_SPEC, FAIRSEQ_SPEC)."; \
	  $(PIP) freeze --exclude-editable | grep -viE '^(torch|fairseq-fixed|headsweep)[ =@]'; } > constraints.txt.new
	@if grep -n ' @ ' constraints.txt.new; then \
		echo "constraints: the lines above are installed from a path or URL, not a registry version" >&2; \
		rm constraints.txt.new; exit 1; fi
	mv constraints.txt.new constraints.txt

demo: install
	headsweep demo

# Two test processes, each with its own local Ray instance, a test file's tests on one process (module fixtures are
# built once): the suite is mostly single-threaded start-up and waiting, so two processes fit CI's two cores.
TEST_WORKERS ?= 2
test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# ruff, and basedpyright (pyrightconfig.json): every import, headsweep.* included, resolves for static tools.
lint:
	ruff check .
	basedpyright

# The peers bench/peers.py measures headsweep against, in a venv of their own that sees this environment's packages
# (--system-site-packages): never a dependency of headsweep or its tests. Installed with the constraints and the torch
# pin, so that no pinned package can move; CHECK_PINS then proves it (every pin of constraints.txt is still the
# version the venv's python imports) and the peers must import. bench/README.md, "The peers".
PEERS_VENV ?= .venv-peers
PEERS_SPEC ?= transformer-lens==4.3.0 nnsight==0.8.1
CHECK_PINS = import sys, re, importlib.metadata as m; key = lambda n: re.sub(r"[-_.]+", "-", n).lower(); \
	have = {key(d.metadata["Name"]): d.version for d in m.distributions()}; \
	pins = [line.split()[0].split("==") for line in open(sys.argv[1]) if "==" in line and line[0].isalnum()]; \
	moved = [f"{n} {v} -> {have.get(key(n), None)}" for n, v in pins if have.get(key(n)) != v]; \
	sys.exit(f"bench-peers: pinned versions moved: {moved}" if moved else 0)

bench-peers:
	@$(PYTHON) -c '$(CHECK_PYTHON)' constraints.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv --system-site-packages $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q -c constraints.txt "$(TORCH_SPEC)" $(PEERS_SPEC)
	$(PEERS_VENV)/bin/python -c '$(CHECK_PINS)' constraints.txt
	$(PEERS_VENV)/bin/python -c "import transformer_lens, nnsight; print('bench-peers: transformer_lens and nnsight import in $(PEERS_VENV); every pin of constraints.txt unchanged')"

# Set-up and checks. `make demo` installs everything and runs the demo; `make test` installs and runs the tests.
PYTHON ?= python
PIP ?= $(PYTHON) -m pip
# The CPU wheel here; on a GPU cluster `make install TORCH_SPEC=torch==2.13.0` from the CUDA index works the same.
TORCH_SPEC ?= torch==2.13.0
FAIRSEQ_SPEC ?= fairseq-fixed==0.12.3.1

.PHONY: install demo test lint bench

install:
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[fairseq,dev]"
	# fairseq-fixed without its dependencies: its torchaudio requirement pulls a CUDA build that breaks
	# transformers (see README), and without build isolation so its C++ extensions build against our torch.
	$(PYTHON) -c "import fairseq" 2>/dev/null || $(PIP) install --no-deps --no-build-isolation "$(FAIRSEQ_SPEC)"

demo: install
	headsweep demo

test: install
	$(PYTHON) -m pytest -q

lint:
	ruff check .

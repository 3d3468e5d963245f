# Two commands do all the set-up: `make demo` and `make test`. Both build ./.venv from nothing
# (torch==2.13.0 first: a looser spec would pull a multi-GB CUDA build) and reuse it while
# pyproject.toml is unchanged.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench format clean nftables

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --no-compile --disable-pip-version-check -e '.[dev]'
	@# Byte-compiled on every core (pip compiles one file at a time). With PYTHONDONTWRITEBYTECODE
	@# set, as on CI, nothing else ever caches a module. Files written for other Pythons fail
	@# here as they do, silently, in pip.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m node.demo

# The tests two at a time (pytest-xdist; those marked `slow` first), then the ones marked
# `serial` alone: they assert bandwidth or wall-clock bounds (the emulated tier, NAT routers,
# gossip latency, timeouts). Both passes run; either one's failure fails the target.
test: nftables $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=15 -n 2 --dist worksteal -m "not serial"; parallel=$$?; \
	$(PY) -m pytest -q --durations=15 -m serial; serial=$$?; \
	exit $$(( parallel || serial ))

# The emulated tier's NAT routers (tests/processes/test_nat.py) need nftables' `nft`; `make test` runs
# this first. As root with apt-get (CI) this installs Debian's nftables when missing (apt-get
# update only if the install fails); elsewhere it says so in one line and those tests skip.
# Never fails the build.
nftables:
	@if command -v nft >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "nftables: nft missing, not installing (needs root and apt-get); tests/processes/test_nat.py will skip"; \
	else \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq nftables >/dev/null 2>&1 \
	  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nftables >/dev/null 2>&1; } \
	  && echo "nftables: installed $$(nft --version)" \
	  || echo "nftables: apt-get could not install it; tests/processes/test_nat.py will skip"; \
	fi

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) benchmarks/codec.py

clean:
	rm -rf $(VENV) build *.egg-info

# fsdp-course: two commands do all the set-up on a fresh machine.
#   make lab    create .venv if missing, install, open JupyterLab on lesson 00 (make lab-zh: the Chinese edition)
#   make site   the course as a static website in build/site/, English and Chinese (docs/AUTHORS.md)
#   make test   create .venv if missing, install, run ruff, the unit tests and nbval on every notebook, the notebooks
#               under another machine's numerics (the portability pass: what another student's CPU computes)
# Python: the first of python3, python3.14 ... python3.10 that torch 2.13 has wheels for (3.10-3.14);
# choose one with `make PYTHON=/path/to/python3.12 ...`.
PYTHON_CANDIDATES := python3 python3.14 python3.13 python3.12 python3.11 python3.10
PYTHON_OK := import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 14))
PYTHON ?= $(firstword $(foreach p,$(PYTHON_CANDIDATES),$(shell command -v $(p) >/dev/null 2>&1 && $(p) -c '$(PYTHON_OK)' 2>/dev/null && echo $(p))))
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TEST_WORKERS ?= 2
NBVAL  := --nbval --nbval-current-env --nbval-cell-timeout=240 --nbval-sanitize-with tests/sanitize.cfg

.PHONY: lab lab-zh site test test-portable test-native notebooks exercises translations lint clean-venv

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "No suitable Python found (looked for: $(PYTHON_CANDIDATES)). torch 2.13 needs" \
		"Python 3.10 to 3.14: install one, or run 'make PYTHON=/path/to/python3.12 ...'."; exit 1; }
	@$(PYTHON) -c '$(PYTHON_OK)' || { echo "$(PYTHON) is not Python 3.10 to 3.14, which torch 2.13 needs:" \
		"run 'make PYTHON=/path/to/python3.12 ...'."; exit 1; }
	@echo "Creating $(VENV) with $$(command -v $(PYTHON)) (Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'))"
	$(PYTHON) -m venv $(VENV)

# a student's install (make lab); the test suite and the authors' tools add the extras classroom and dev
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

# one pip run for both (an editable build costs seconds): it is also the student's install
$(DEV_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[classroom,dev,site]"
	touch $(STAMP) $(DEV_STAMP)

lab: $(STAMP)
	$(BIN)/python -m fsdp_course.classroom.lab

lab-zh: $(STAMP)
	$(BIN)/python -m fsdp_course.classroom.lab --lang zh

# the course as a website in build/site/ (both languages), from the saved notebooks: nothing runs, nothing is fetched
site: $(DEV_STAMP)
	$(BIN)/python docs/site/build.py --out build/site

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

test: $(DEV_STAMP)
	$(BIN)/ruff check .
	@# build matplotlib's font cache first: its one-time warning would otherwise land in a notebook cell
	$(BIN)/python -c "import matplotlib.font_manager"
	@# the course's bytecode once, for the few hundred processes that import it (kernels, torchrun ranks): where
	@# PYTHONDONTWRITEBYTECODE is set, as on CI machines, each of them would compile it again (about 1 s each)
	$(BIN)/python -m compileall -q fsdp_course
	@# one run: the unit tests under this CPU's kernels, nbval's notebook kernels under another machine's numerics
	@# (tests/portable.py tells ATen, oneDNN, MKL, numpy and OpenBLAS the same CPU, an AVX2 one, and checks first
	@# that they all believe it). TEST_WORKERS=3 fills the fifth of the workers' time that is waiting, but on two
	@# cores it measured from 13 s faster to 73 s slower (sys time 148 s -> 245 s: contention): two by default
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15 $(NBVAL) --notebook-numerics=portable \
		tests lessons solutions

test-portable: $(DEV_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(NBVAL) --notebook-numerics=portable lessons solutions

# nbval under this CPU's own kernels: the notebooks were saved under them (make notebooks), so make test leaves this
# pass out (see README, "Notebooks are claims"); authors run it on a CPU unlike the one they saved on
test-native: $(DEV_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(NBVAL) lessons solutions

# Authors: re-run every lesson and solution in a fresh kernel and save it with its outputs.
notebooks: $(DEV_STAMP)
	$(BIN)/python -m fsdp_course.classroom.notebooks run lessons/*.ipynb solutions/*.ipynb

exercises: $(DEV_STAMP)
	$(BIN)/python -m fsdp_course.classroom.exercises generate

# Authors: the Chinese edition (lessons/zh/, exercises/zh/) from the English notebooks and i18n/zh/ catalogs;
# figures are drawn again in Chinese where their English figure changed. `... translations status` lists what is due.
translations: $(DEV_STAMP)
	$(BIN)/python -m fsdp_course.classroom.translations build

clean-venv:
	rm -rf $(VENV)

# fsdp-course: two commands do all the set-up on a fresh machine.
#   make lab    create .venv if missing, install, open JupyterLab on lesson 00
#   make test   create .venv if missing, install, run ruff, the unit tests and nbval on the notebooks
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lab test exercises lint clean-venv

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is needed: install it, or run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

lab: $(STAMP)
	$(BIN)/python -m fsdp_course.lab

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	@# build matplotlib's font cache first: its one-time warning would otherwise land in a notebook cell
	$(BIN)/python -c "import matplotlib.font_manager"
	$(BIN)/python -m pytest -n 2 --dist loadfile \
		--nbval --nbval-current-env --nbval-cell-timeout=240 \
		--nbval-sanitize-with tests/sanitize.cfg \
		tests lessons solutions

exercises: $(STAMP)
	$(BIN)/python -m fsdp_course.exercises generate

clean-venv:
	rm -rf $(VENV)

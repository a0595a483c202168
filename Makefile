# Two commands: `make run` (the control plane on embedded defaults, with a demo
# fleet) and `make test` (the whole suite). Both set up .venv themselves.

SHELL := bash
.SHELLFLAGS := -o pipefail -c
# The first Python 3.11+ with venv whose interpreter every user can run: jobs run as
# unprivileged users of their own (README, Security), and on a local node they run this
# venv's Python. A pyenv build under a home directory closed to others would not do.
PYTHON ?= $(shell for p in /usr/bin/python3 /usr/local/bin/python3 python3; do \
	"$$p" -c 'import sys, venv, ensurepip, os; sys.exit(sys.version_info < (3, 11) or \
	not all(os.stat(d).st_mode & 1 for d in __import__("pathlib").Path(os.path.realpath(sys.executable)).parents))' \
	2>/dev/null && { echo "$$p"; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
# pip prints a warning for every package its local mirrors lack; keep the output readable.
PIP := $(BIN)/pip install --quiet --disable-pip-version-check
QUIET_PIP := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# Development settings, set explicitly: DEBUG on, a secret key made once under
# var/, plain http on 127.0.0.1, SQLite and the filesystem broker (no DATABASE_URL
# or REDIS_URL), so `make run` needs nothing but Python.
DEV_ENV := DJANGO_DEBUG=1 SECRET_KEY_FILE=var/secret_key SECURE_COOKIES=0 \
	ALLOWED_HOSTS=127.0.0.1,localhost DATABASE_URL= REDIS_URL= CELERY_BROKER_URL= \
	CONTROLPLANE_URL=http://127.0.0.1:$(PORT) NODE_MIN_FREE_DISK_GB=1

.PHONY: run test test-fast drills lint format bench bench-api bench-costs bench-heartbeats bench-pages bench-advisor bench-scheduler bench-trainer bench-scaling bench-finetune bench-overlap bench-fp8 clean install system-test-deps

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# The CPU wheel first, so nothing that asks for torch pulls a CUDA build.
	$(PIP) torch==2.13.0 numpy $(QUIET_PIP)
	$(PIP) -e '.[trainer,dev]' $(QUIET_PIP)
	$(BIN)/python -c "import django, rest_framework, celery, torch; print('installed: django', django.__version__, '· torch', torch.__version__)"
	touch $@

install: $(VENV)/.installed

var/secret_key:
	mkdir -p var
	umask 077 && $(BIN)/python -c "import secrets; print(secrets.token_urlsafe(50))" > $@

run: $(VENV)/.installed var/secret_key
	$(DEV_ENV) $(BIN)/python manage.py migrate --no-input -v 0
	$(DEV_ENV) $(BIN)/python manage.py createcachetable -v 0
	$(DEV_ENV) $(BIN)/python manage.py demo_fleet
	$(DEV_ENV) $(BIN)/python manage.py demo_prices
	$(DEV_ENV) $(BIN)/python manage.py demo_training
	$(DEV_ENV) exec $(BIN)/python -m controlplane.devserver --port $(PORT)

# What the browser and SSH tests start for real: Debian's chromium and OpenSSH.
system-test-deps:
	@command -v chromium >/dev/null && test -x /usr/sbin/sshd || \
		( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium openssh-server >/dev/null )

test: $(VENV)/.installed system-test-deps
	$(BIN)/python -m tests.report_backends
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest $(PYTEST_ARGS)

# The fault drills: the product in its production shape (its own PostgreSQL and Redis,
# gunicorn, a Celery worker and beat, local and SSH nodes), each fault played for real.
# Run after `make test` by .ci/run; root, for PostgreSQL's own user and the jobs' users.
drills: $(VENV)/.installed system-test-deps
	$(BIN)/python -m pytest tests/drills --confcutdir=tests/drills -p no:django \
		-W ignore::pytest.PytestConfigWarning $(PYTEST_ARGS)

# The quick tier: no browser, no fuzzing, no subprocess servers.
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -m "not browser and not slow" $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.installed
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(VENV)/.installed
	$(BIN)/python -m bench.fleet

# Job submissions through the API under gunicorn (PostgreSQL): open loop, then closed loop.
bench-api: $(VENV)/.installed
	$(BIN)/python -m bench.api

# 10 million ledger rows loaded with COPY, then the finance queries timed (bench/costs.py);
# needs DATABASE_URL (PostgreSQL). BENCH_ROWS loads fewer.
bench-costs: $(VENV)/.installed
	$(BIN)/python -m bench.costs

# 10,000 node agents heartbeating every 10 s under gunicorn (open loop);
# needs DATABASE_URL (PostgreSQL) and REDIS_URL. BENCH_SECONDS shortens it.
bench-heartbeats: $(VENV)/.installed
	@command -v wrk >/dev/null || ( apt-get update -qq && apt-get install -y -qq wrk >/dev/null )
	$(BIN)/python -m bench.heartbeats

# Every page and live fragment at design size (100,000 jobs, 10,000 nodes, a month of
# history), server time and queries (bench/pages.py); needs DATABASE_URL (PostgreSQL).
# BENCH_JOBS and BENCH_NODES make it smaller.
bench-pages: $(VENV)/.installed
	$(BIN)/python -m bench.pages

# The scheduling pass at design size (the planner alone, then read, plan and write on the
# database); set DATABASE_URL to measure on PostgreSQL.
bench-scheduler: $(VENV)/.installed
	$(BIN)/python -m bench.scheduler_plan
	$(BIN)/python -m bench.scheduler

# The memory model against the trainer's measured peak on one GPU (bench/advisor.py); without
# a GPU it prints the model's predictions for the same rows.
bench-advisor:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m bench.advisor $(BENCH_ARGS); \
	else $(MAKE) --no-print-directory install && $(BIN)/python -m bench.advisor $(BENCH_ARGS); fi

# The trainer against Hugging Face's LlamaForCausalLM, compiled and with Liger's kernels, on one
# GPU (bench/trainer.py). It needs python3 with torch (transformers and liger-kernel for the
# peers), not .venv: on a GPU machine the system's python3; without a GPU it says so and runs
# a tiny CPU smoke configuration.
bench-trainer:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m bench.trainer $(BENCH_ARGS); \
	else $(MAKE) --no-print-directory install && $(BIN)/python -m bench.trainer $(BENCH_ARGS); fi

# The trainer's scaling over every GPU of one host, per layout; on the CPU, the same
# layouts with gloo and 8 processes on the small preset (a check, not a figure).
bench-scaling:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m bench.trainer --scaling $(BENCH_ARGS); \
	else $(MAKE) --no-print-directory install && $(BIN)/python -m bench.trainer --scaling $(BENCH_ARGS); fi

# A fine-tuning run from a Hugging Face checkpoint made on the spot from real text
# (bench/finetune.py): its first loss against the checkpoint's own and a random model's.
bench-finetune:
	@if $(PYTHON) -c "import torch, tokenizers, transformers" 2>/dev/null; then $(PYTHON) -m bench.finetune $(BENCH_ARGS); \
	else $(MAKE) --no-print-directory install && $(BIN)/python -m bench.finetune $(BENCH_ARGS); fi

# Whether fused AdamW's update can hide beside the forward's matrix products (bench/overlap.py).
bench-overlap:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m bench.overlap $(BENCH_ARGS); \
	else $(MAKE) --no-print-directory install && $(BIN)/python -m bench.overlap $(BENCH_ARGS); fi

bench-fp8:
	@if $(PYTHON) -c "import torch, tokenizers, torchao" 2>/dev/null; then $(PYTHON) -m bench.fp8 $(BENCH_ARGS); \
	else $(MAKE) --no-print-directory install && $(BIN)/python -m bench.fp8 $(BENCH_ARGS); fi

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache .hypothesis

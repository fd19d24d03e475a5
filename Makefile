# The two commands of the README. Both set up the environment first (idempotent:
# a no-op when .venv already matches requirements/lock.txt and pyproject.toml).
.PHONY: setup run test

setup:
	@./scripts/setup.sh

run: setup
	@./scripts/main_job.sh

test: setup
	@.venv/bin/ruff check .
	@.venv/bin/python -m pytest -q --durations=40 -n 3 --dist loadfile --no-loadscope-reorder
	@.venv/bin/python -m router_ext.vectors --check
	@cd router_ext/epp && go test ./...

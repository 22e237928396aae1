# One-command set-up and checks. See README.md.
.PHONY: install demo test benchmark clean-venv

install:
	bash tools/setup_env.sh

demo: install
	.venv/bin/python tools/demo.py

test: install
	.venv/bin/python -m pytest -n auto --dist loadfile tests

clean-venv:
	rm -rf .venv

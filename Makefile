# The two commands: `make demo` (set up everything, run a demo job you can watch) and `make test`;
# `make quick` runs the unit and API tests only (the inner loop).
SHELL := /bin/bash

.PHONY: demo test quick setup bench stop

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

quick:
	bash scripts/test.sh --quick

setup:
	bash scripts/bootstrap.sh

bench:
	bash scripts/bench.sh

stop:
	bash scripts/demo.sh stop

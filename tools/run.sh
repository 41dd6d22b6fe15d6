#!/bin/sh
# The jobs are tools/run.py's (check, test, matrix, docs, wheels): this only hands over.
exec python3 "$(dirname "$0")/run.py" "$@"

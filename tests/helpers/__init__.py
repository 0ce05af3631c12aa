"""Helpers the test modules share: plain functions, constants and small
models, no fixtures or hooks (those live in ``tests/conftest.py``).  Test
modules import them as ``from helpers.<module> import ...`` (pytest puts
``tests/`` on ``sys.path``); no test module imports another."""

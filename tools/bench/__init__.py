"""``hydra-rpc bench``: the performance budgets of docs/performance.md, measured side by side.

Each scenario module starts its own server process(es) on 127.0.0.1, drives them from
this (client) process or from worker subprocesses, and returns a :class:`~tools.bench.common.Result`
holding the raw samples, a summary, and one row per budget with the ratio to a baseline
measured in the same run.
"""

"""``hydra-rpc fuzz``: a protocol fuzzer for Hydra engine ports (and the ggml-RPC passthrough).

Layout (each module is small enough to read in one sitting):

* ``cases``      — the Case / Message / Outcome data model and the case-file format;
* ``templates``  — one valid request for every opcode and dialect, built with the codec;
* ``mutators``   — framing and transport mutations (magic, op, flags, keys, length lies,
                   truncation, pipelining, slow-loris dribbling, abrupt closes, havoc);
* ``payload_mutators`` — payload-aware ones (JSON structure, every DECODE v3 rule, KV blobs,
                   SWAP_QUANT, dialect boundaries), lengths and hashes kept valid;
* ``config_mutators`` — every CONFIGURE / ``hydra_config`` key, values by type and range;
* ``schedule``   — ``case_at(seed, index)``: which case has which index (cheap decisive
                   cases first); pure, so a seed and an index address one case forever;
* ``stateful``   — seeded step programs over a model of the slots, with invariants (and
                   real KV blobs with one field inside the state region changed);
* ``slow``       — ``--slow-senders``: background dribblers a server must cut;
* ``target``     — connecting to the target and, with ``--spawn``, running and restarting it
                   (exit code/signal and peak RSS come from here);
* ``responses``  — reading Hydra responses (incl. PIN piece streams) under deadlines;
* ``oracles``    — what must hold after each case (liveness, no desync, defined status…);
* ``execute``    — running one case against a target and judging it;
* ``ggml_mode``  — ggml-RPC cases through a passthrough (``--protocol ggml``);
* ``codec_mode`` — in-process decoder fuzzing with differential checks (``--codec``);
* ``minimize``   — shrinking a failing case while it still fails the same oracle;
* ``explain``    — a finding's input (opcode, key, mutated field and value), tracebacks in
                   ``target.log``, memory growth the request asked for;
* ``runner``     — the run loop, findings, reproducers, replay;
* ``progress``   — live progress, the summary table;
* ``cli``        — ``add_arguments`` / ``run`` for the ``hydra-rpc fuzz`` subcommand.
"""

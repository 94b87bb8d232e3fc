from hydra_rpc.cli import main

raise SystemExit(main())

from hybridserve.cli import main

raise SystemExit(main())

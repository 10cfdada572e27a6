from jaxlm.compress.cli import main

raise SystemExit(main())

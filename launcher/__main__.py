from launcher.tritonserver import main

raise SystemExit(main())

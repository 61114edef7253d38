"""``python -m pd_cluster.ray_launcher ray ...``: the same commands as ``pd-cluster ray ...``."""

from pd_cluster.ray_launcher.cli import main

raise SystemExit(main())

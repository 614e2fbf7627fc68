"""`python -m tf_dlt.server`: run one shard server."""

import sys

from tf_dlt.server.main import main

sys.exit(main())

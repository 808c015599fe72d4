import sys

from shardline.cli.main import main

sys.exit(main())

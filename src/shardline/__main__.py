import sys

from shardline.cli import main

sys.exit(main())

import os
import sys

from shardline.runner.process import main

code = main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # skip interpreter teardown: zenoh and MLX threads must not delay or hang the exit

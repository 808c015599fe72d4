"""What crosses processes and machines: typed messages, frames, zenoh links with deadlines, group sums."""

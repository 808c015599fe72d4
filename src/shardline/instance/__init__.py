"""What every role shares about an instance: settings, runner specs and slots, generation ids, deadlines."""

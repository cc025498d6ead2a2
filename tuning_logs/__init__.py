"""Tuning records per target, in TVM MetaSchedule's JSON database format (see README.md)."""

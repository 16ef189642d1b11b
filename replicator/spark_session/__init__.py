"""Spark sessions for the Delta warehouse's views and Spark readers, and the streaming source:
Delta's jars and SQL extension, s3a for object storage, quiet logs (session.py, jars.py)."""

"""The queue as a Spark streaming source (`spark.readStream.format("replicator")`)."""

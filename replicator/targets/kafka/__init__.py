"""Kafka: the publisher (a target writing Debezium-compatible change topics), and the topics' records,
names and settings, which the followers (replicator.follower) read too."""

"""Kafka: Debezium-compatible change topics (publisher) and the followers that apply them."""

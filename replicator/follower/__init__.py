"""The follower: a publisher's Kafka topics applied to a target of its own (`replicator follow`),
beside the consumer, which applies the source's queue."""

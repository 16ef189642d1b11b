"""Incremental views of a SQLite target: storage, capture of changes, refresh.

A view NAME is stored in table ``_replicator_mv_NAME`` and read through the SQL view ``NAME``;
while a batch is applied, TEMP triggers capture the old and new rows of its changes to the
views' base tables, and just before the batch's COMMIT, in its transaction, each view it touched
is refreshed from them (or in full). The modules, each with one job:

- sqlite_views: SqliteViews, the ViewStore of the `view` commands and the hooks SqliteTarget calls;
- catalog: the catalog tables (definitions, the refresh log);
- planner: a definition analysed against the replica, planned; plan: the Plan it gives;
- statements: the SQL of a plan's refreshes; refresh: running them (auto: when to go full);
- capture: the TEMP triggers and deltas; temp: the TEMP work tables;
- storage: a view's storage table and the indexes maintenance seeks through;
- tables: the replica's tables as the analysis sees them; names: the names of all of these;
- sql: quoting and column definitions.
"""

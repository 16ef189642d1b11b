"""An incremental refresh of a view of a Delta warehouse: the rows a change affects,
recomputed, and what the view must delete.

What is a lookup by key is done with pyarrow on the driver
(replicator.targets.delta.keyset compares keys as Spark does): the changed
keys and their old rows come from where the commits marked them deleted, their
new rows from the table's key index (replicator.targets.delta.changes); the
rows an equi-join pairs with the changed rows are read from the other tables'
files by the join columns; the view's stored keys from its own index (an
aggregate's) or its key columns (a row view's). Spark evaluates the query, over
those rows handed to it as local relations or over the tables read at the
view's versions, and its result is collected: a refresh holds at most
DRIVER_MAX_KEYS changed keys (past them the view is refreshed in full).

- aggregate and DISTINCT views: the affected keys are the key values of every
  combination of rows with at least one changed row, the query's FROM/WHERE
  evaluated once per non-empty subset of its changed tables, those read from
  their delta (the old and new rows of the changed keys); plain columns of one
  table are read off the delta by pyarrow. The defining query restricted to
  those keys gives their new rows; keys it no longer gives are deleted.
- row views (filter/projection, inner joins): a view row is named by the keys
  of the base rows it combines; the combinations holding a changed base row are
  recomputed, the view rows naming a changed key and not given again are
  deleted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import pyarrow as pa

from replicator.structure import target_table_name
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.changes import (
    TableChanges,
    current_rows,
    file_schema,
    key_names,
    logical_names,
    rows_matching,
)
from replicator.targets.delta.index import canonical_keys
from replicator.targets.delta.keyset import KeySet, category, distinct, largest_group
from replicator.targets.delta.spark_sql import quote_spark
from replicator.targets.delta.table import ReplicaTable
from replicator.targets.delta.view_plan import ViewPlan, too_large
from replicator.targets.delta.view_table import ViewTable

DRIVER_MAX_KEYS = 1_000_000    # changed keys (rows looked up) a refresh holds on the driver


def spark_struct(fields: list[dict[str, Any]], names: list[str] | None = None) -> Any:
    """A Spark schema of Delta schema fields (renamed to names if given), all nullable."""
    from pyspark.sql import types as T
    return T.StructType.fromJson({"type": "struct", "fields": [
        {"name": names[i] if names else f["name"], "type": f["type"], "nullable": True, "metadata": {}}
        for i, f in enumerate(fields)]})


def local_frame(spark: Any, rows: pa.Table, table: ReplicaTable) -> Any:
    """Rows of a table (physical column names, all its columns) as a Spark DataFrame with
    the table's column names: a local relation, which Spark reads without a job."""
    logical = logical_names(table)
    return spark.createDataFrame(rows.rename_columns([logical[n] for n in rows.column_names]),
                                 schema=spark_struct(table.schema()["fields"]))


def key_frame(spark: Any, keys: pa.Table, table: ReplicaTable) -> Any:
    """A table's key values (key columns, physical names) as a Spark DataFrame of columns c0..."""
    fields = table.schema()["fields"]
    positions = table.structure().key_positions()
    return spark.createDataFrame(keys.rename_columns([f"c{j}" for j in range(keys.num_columns)]),
                                 schema=spark_struct([fields[i] for i in positions],
                                                     [f"c{j}" for j in range(len(positions))]))


@dataclass
class Done:
    """What a refresh did: its kind (incremental, none), the keys it recomputed and its row
    counts; or, in full, why a full refresh is wanted instead."""
    kind: str = "incremental"
    keys: int = 0
    deleted: int = 0
    inserted: int = 0
    updated: int = 0
    full: str | None = None


class Refresher:
    """One incremental refresh of a view, staged in its table (the caller commits it)."""

    def __init__(self, spark: Any, plan: ViewPlan, entry: dict[str, Any], view: ViewTable, warehouse: Any,
                 changes: dict[str, TableChanges], register: Callable[[set[str]], None]) -> None:
        """changes: per directory, what changed in the tables since the view's versions;
        register(source names): the tables as temporary views, at the versions refreshed to."""
        self.spark, self.plan, self.view = spark, plan, view
        self.changes, self.register = changes, register
        names = {}
        for d, name in warehouse.directories().items():
            schema, _, bare = name.partition(".")
            names[target_table_name(schema, bare).lower()] = d
        a = plan.analysis
        self.directories = [names[o.table.name.lower()] for o in a.occurrences]
        self.tables: list[ReplicaTable] = [warehouse.table(d) for d in self.directories]
        self.with_delta = [i for i, d in enumerate(self.directories) if d in changes]
        self.deps = set(entry["deps"])
        self._keys: dict[str, pa.Table] = {}
        self._new: dict[str, pa.Table] = {}
        self._registered = 0

    # what changed, per table ------------------------------------------------------------

    def keys(self, directory: str) -> pa.Table:
        """The table's changed keys, distinct (key columns, physical names)."""
        if directory not in self._keys:
            keys = self.changes[directory].changed_keys()
            self._keys[directory] = keys.group_by(keys.column_names, use_threads=False).aggregate([]) \
                .select(keys.column_names) if keys.num_rows else keys
        return self._keys[directory]

    def new_rows(self, directory: str) -> pa.Table:
        """The live rows of the changed keys (physical names)."""
        if directory not in self._new:
            table = self.changes[directory].table
            self._new[directory] = current_rows(table, self.keys(directory))
        return self._new[directory]

    def delta_rows(self, directory: str) -> pa.Table:
        """The old and new rows of the changed keys (physical names)."""
        return pa.concat_tables([self.changes[directory].old_rows(), self.new_rows(directory)])

    def _name(self, prefix: str) -> str:
        self._registered += 1
        return f"_replicator_{prefix}{self._registered}"

    # the refresh ---------------------------------------------------------------------------

    def run(self) -> Done:
        changed = sum(self.keys(d).num_rows for d in {self.directories[i] for i in self.with_delta})
        if changed > DRIVER_MAX_KEYS:
            return Done(full=f"THRESHOLD: {changed} changed keys, more than a refresh holds ({DRIVER_MAX_KEYS})")
        if not self.with_delta:
            return Done(kind="none")
        if self.plan.analysis.kind == "rows":
            return self._rows()
        return self._aggregate()

    def _stored_key_types(self) -> list[pa.DataType]:
        schema = file_schema(self.view.table)
        return [schema.field(n).type for n in key_names(self.view.table)]

    def _write(self, recomputed: pa.Table, deleted: pa.Table) -> None:
        """The recomputed rows (plan key columns, then the query's) and the deleted keys into
        the view's table, in its column order."""
        columns = [c.name for c in self.view.table.structure().columns]
        upserts = recomputed.select(columns)
        self.view.table.change_rows(upserts, deleted)

    def _recomputed_keys(self, recomputed: pa.Table) -> KeySet:
        return KeySet([recomputed.column(k) for k in self.plan.key_columns])

    def _aggregate(self) -> Done:
        plan, spark = self.plan, self.spark
        found = self._affected_on_driver()
        if found is None:
            self.register(self.deps)
            delta = {}
            for i in self.with_delta:
                d = self.directories[i]
                name = self._name("delta")
                local_frame(spark, self.delta_rows(d), self.tables[i]).createOrReplaceTempView(name)
                delta[i] = name
            subsets = [s for size in range(1, len(self.with_delta) + 1) for s in combinations(self.with_delta, size)]
            affected = spark.sql(" UNION ".join(plan.affected_keys(s, delta) for s in subsets))
            found = affected.toArrow()
        types = self._stored_key_types()
        found = pa.Table.from_arrays([found.column(j).cast(t) for j, t in enumerate(types)],
                                     names=[f"c{j}" for j in range(len(types))])
        n = found.num_rows
        rows = self.view.rows()
        if too_large(plan, n, rows):
            return Done(full=f"THRESHOLD: {n} affected keys, view of {rows} rows")
        if not n:
            return Done(kind="none")
        recomputed = self._recompute_local(found)
        if recomputed is None:
            self.register(self.deps)
            keys = self._name("keys")
            view_fields = self.view.table.schema()["fields"]
            key_positions = self.view.table.structure().key_positions()
            spark.createDataFrame(found, schema=spark_struct([view_fields[i] for i in key_positions],
                                                             found.column_names)).createOrReplaceTempView(keys)
            cond = " AND ".join(f"({e}) <=> _replicator_x.c{j}" for j, e in enumerate(plan.key_exprs))
            recomputed = self._collect(plan.select(semi=(keys, cond)))
        index = self.view.table.ensure_index()
        located = index.locate(canonical_keys(found.columns, index.integer))
        existing = found.filter(pa.array([location >= 0 for location in located], type=pa.bool_()))
        gone = self._recomputed_keys(recomputed).keep(existing, existing.column_names, inside=False)
        self._write(recomputed, gone)
        updated = existing.num_rows - gone.num_rows
        return Done(keys=n, deleted=gone.num_rows, inserted=recomputed.num_rows - updated, updated=updated)

    def _plain_keys(self) -> list[str] | None:
        """The physical names of the columns an aggregate (or DISTINCT) view's keys are, when
        they are plain columns of its one table; None otherwise."""
        a = self.plan.analysis
        plain = [k for k in a.key_columns if k is not None]
        if len(a.occurrences) != 1 or a.conditions or not a.key_columns or len(plain) != len(a.key_columns):
            return None
        physical = {f["name"]: delta_schema.physical_name(f) for f in self.tables[0].schema()["fields"]}
        return [physical[k[1]] for k in plain]

    def _recompute_local(self, found: pa.Table) -> pa.Table | None:
        """An aggregate (or DISTINCT) view's rows for the affected keys, when those are plain
        columns of its one table: the table's rows of those keys are read on the driver (by
        their columns, as joins are) and Spark evaluates the query over them, a local
        relation, reading no file. None when they are more than DRIVER_MAX_KEYS rows."""
        columns = self._plain_keys()
        if columns is None:
            return None
        rows = rows_matching(self.tables[0], [(columns, KeySet(found.columns))], DRIVER_MAX_KEYS)
        if rows is None:
            return None
        name = self._name("groups")
        local_frame(self.spark, rows, self.tables[0]).createOrReplaceTempView(name)
        return self._collect(self.plan.select(relations={0: name}))

    def _affected_on_driver(self) -> pa.Table | None:
        """An aggregate (or DISTINCT) view's affected keys (columns c0...) computed by pyarrow,
        when they are plain columns of its one table, read without a filter: the distinct
        values of those columns in the delta. None otherwise (Spark evaluates the key
        expressions), and for float keys, whose -0.0 and 0.0 (and NaNs) Arrow would keep
        apart where Spark's grouping makes them one."""
        columns = self._plain_keys()
        if columns is None or self.plan.analysis.where \
                or any(pa.types.is_floating(t) for t in self._stored_key_types()):
            return None
        rows = self.delta_rows(self.directories[0])
        found = rows.select(columns).group_by(columns, use_threads=False).aggregate([]).select(columns)
        return found.rename_columns([f"c{j}" for j in range(len(columns))])

    def _rows(self) -> Done:
        plan = self.plan
        n_keys = sum(distinct(self.keys(self.directories[i]), self.keys(self.directories[i]).column_names)
                     for i in self.with_delta)
        rows = self.view.rows()
        if too_large(plan, n_keys, rows):
            return Done(full=f"THRESHOLD: {n_keys} changed keys, view of {rows} rows")
        recomputed = self._changed_rows_local()
        if recomputed is None:
            recomputed = self._changed_rows_spark()
        stored_key_names = key_names(self.view.table)
        storage_index = {k: j for j, k in enumerate(plan.key_columns)}
        wanted = []
        for i in self.with_delta:
            columns = [stored_key_names[storage_index[k]] for k in plan.occurrence_keys(i)]
            wanted.append((columns, KeySet(self.keys(self.directories[i]).columns)))
        stored = rows_matching(self.view.table, wanted, 1 << 62, stored_key_names)
        assert stored is not None   # no limit
        gone = self._recomputed_keys(recomputed).keep(stored, stored_key_names, inside=False)
        self._write(recomputed, gone)
        updated = stored.num_rows - gone.num_rows
        return Done(keys=n_keys, deleted=gone.num_rows, inserted=recomputed.num_rows - updated, updated=updated)

    def _changed_rows_local(self) -> pa.Table | None:
        """A row view's recomputed rows from rows looked up on the driver, when the view's
        equi-joins lead there: no table is scanned. Per changed occurrence i (a branch), i
        reads the new rows of the changed keys of its table; each other occurrence reads the
        rows of its table that an equi-join condition pairs with the rows found for a
        neighbour (a superset of those its combinations can hold, which the query then
        filters); a changed occurrence of an earlier branch leaves out its changed keys
        (those combinations are that branch's). None when an occurrence is not reached
        through conditions between columns of one category, or more than DRIVER_MAX_KEYS
        rows would be held (the caller has Spark scan the tables)."""
        a, spark = self.plan.analysis, self.spark
        schemas = [file_schema(t) for t in self.tables]
        physical = [{f["name"]: delta_schema.physical_name(f) for f in t.schema()["fields"]}
                    for t in self.tables]
        pairs = [(x, y) for x, y in a.equi] + [(y, x) for x, y in a.equi]
        held = 0
        branches = []
        for i in self.with_delta:
            found: dict[int, pa.Table] = {i: self.new_rows(self.directories[i])}
            if not found[i].num_rows:   # only deletions of i: no combination holds a new row of it
                found.update({j: schemas[j].empty_table() for j in range(len(a.occurrences)) if j != i})
            while len(found) < len(a.occurrences):
                reached = next(((j, r) for (r, _), (j, _) in pairs if r in found and j not in found), None)
                if reached is None:
                    return None
                j, r = reached
                link = [(physical[r][cr], physical[j][cj]) for (rr, cr), (jj, cj) in pairs if rr == r and jj == j]
                if any(category(schemas[r].field(pr).type) is None
                       or category(schemas[r].field(pr).type) != category(schemas[j].field(pj).type)
                       for pr, pj in link):
                    return None
                paired = KeySet([found[r].column(pr) for pr, _ in link])
                rows = rows_matching(self.tables[j], [([pj for _, pj in link], paired)], DRIVER_MAX_KEYS - held)
                if rows is None:
                    return None
                if j in self.with_delta and j < i:
                    keys = key_names(self.tables[j])
                    rows = KeySet(self.keys(self.directories[j]).columns).keep(rows, keys, inside=False)
                found[j] = rows
                held += rows.num_rows
                if largest_group(rows, [pj for _, pj in link]) > DRIVER_MAX_KEYS:
                    return None
            names = {}
            for j, rows in found.items():
                names[j] = self._name(f"r{i}_{j}_")
                local_frame(spark, rows, self.tables[j]).createOrReplaceTempView(names[j])
            branches.append(self.plan.select(relations=names))
        return self._collect(" UNION ALL ".join(branches))

    def _changed_rows_spark(self) -> pa.Table:
        """A row view's recomputed rows from the tables at the view's versions: with one
        changed occurrence, its table replaced by the new rows of its changed keys (the table
        has no other rows for those keys); with several, the combinations matching any of
        their key sets (existence joins under one OR: each table scanned once)."""
        spark, a = self.spark, self.plan.analysis
        self.register(self.deps)
        if len(self.with_delta) == 1:
            i = self.with_delta[0]
            name = self._name("new")
            local_frame(spark, self.new_rows(self.directories[i]), self.tables[i]).createOrReplaceTempView(name)
            return self._collect(self.plan.select(relations={i: name}))
        restrict = []
        for i in self.with_delta:
            name = self._name("pk")
            key_frame(spark, self.keys(self.directories[i]), self.tables[i]).createOrReplaceTempView(name)
            o = a.occurrences[i]
            restrict.append((name, " AND ".join(f"{quote_spark(o.alias)}.{quote_spark(k)} <=> _replicator_x.c{j}"
                                                for j, k in enumerate(o.table.key))))
        return self._collect(self.plan.select(any_of=restrict))

    def _collect(self, select: str) -> pa.Table:
        return self.spark.sql(select).toDF(*self.plan.key_columns, *self.plan.columns).toArrow()

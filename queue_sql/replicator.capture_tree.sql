CREATE OR REPLACE FUNCTION replicator.capture_tree(p_table oid)
RETURNS SETOF oid
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_tree(p_table)
--
--      The relations whose rows are rows of a captured table: the table
--      and its descendants, found recursively through pg_inherits (the
--      partitions of a partitioned table; the inheritance children of a
--      plain table, their children, ...). A statement fires the statement
--      triggers of the table it names only, so each of them carries the
--      table's capture triggers. `SELECT * FROM table` (no ONLY) reads
--      exactly their rows: the initial copy and the PK-only join-back.
--
-- Parameters:
--      p_table     - the captured table
--
-- Returns:
--      its oid and the oids of its descendants, each once
-- ----------------------------------------------------------------------
    WITH RECURSIVE tree(relid) AS (
        SELECT p_table
        UNION
        SELECT h.inhrelid FROM tree JOIN pg_inherits h ON h.inhparent = tree.relid)
    SELECT relid FROM tree;
$$;

CREATE OR REPLACE FUNCTION replicator.capture_ancestors(p_rel oid)
RETURNS SETOF oid
LANGUAGE sql STABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.capture_ancestors(p_rel)
--
--      A relation and its ancestors, found recursively through pg_inherits
--      (partitioned tables it is a partition of, tables it inherits from):
--      the tables whose capture trees it may belong to.
--
-- Parameters:
--      p_rel       - a relation
--
-- Returns:
--      its oid and the oids of its ancestors, each once
-- ----------------------------------------------------------------------
    WITH RECURSIVE up(relid) AS (
        SELECT p_rel
        UNION
        SELECT h.inhparent FROM up JOIN pg_inherits h ON h.inhrelid = up.relid)
    SELECT relid FROM up;
$$;

CREATE OR REPLACE FUNCTION replicator.check_capture_tree(p_table regclass, p_key text[], p_queue_name text,
                                                         p_table_id integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.check_capture_tree(p_table, p_key, p_queue_name, p_table_id)
--
--      Refuses, with the way out, a capture tree (replicator.capture_tree)
--      whose capture could miss a change. Called by add_table before a
--      table is captured and after every DDL that may change the tree
--      (replicator.sync_partitions), where the exception rolls the DDL
--      back. Refused:
--      - a table that is a partition or an inheritance child: statements
--        naming its parent change its rows without firing its statement
--        triggers (capture the root, which includes its rows);
--      - a descendant that is itself captured (in any queue), for the same
--        reason;
--      - a descendant that also inherits from a table outside the tree:
--        statements naming that table change its rows unseen;
--      - a descendant that is not a plain or partitioned table (a foreign
--        table cannot carry triggers with transition tables) or is
--        temporary (`SELECT * FROM table` reads it in its session only);
--      - a descendant where a key column the table has NOT NULL may be
--        NULL (PostgreSQL allows DROP NOT NULL on an inheritance child):
--        targets rely on NOT NULL key columns, pk mode reads rows back by
--        their key.
--      The way out for a descendant names DETACH PARTITION for a partition
--      (PostgreSQL refuses NO INHERIT there). The tree is walked once; a
--      partition is checked from its pg_class row and the one query for
--      descendants captured on their own (it has one parent, in the tree,
--      and its parent's NOT NULL columns), so a tree of n partitions costs
--      a constant number of queries.
--
-- Parameters:
--      p_table      - the captured table, or the one about to be
--      p_key        - its key columns
--      p_queue_name - its queue, for the messages
--      p_table_id   - its replicator.captured_table id; NULL when adding
-- ----------------------------------------------------------------------
DECLARE
    v_partition boolean;
    v_parent regclass;
    v_root regclass;
    v_owner text;
    v_tree oid[];
    v_member record;
BEGIN
    SELECT c.relispartition,
           (SELECT h.inhparent::regclass FROM pg_inherits h WHERE h.inhrelid = c.oid ORDER BY h.inhseqno LIMIT 1)
    INTO v_partition, v_parent
    FROM pg_class c WHERE c.oid = p_table;
    IF v_parent IS NOT NULL THEN
        -- the topmost ancestor: capturing it includes this table's rows
        SELECT a::regclass INTO v_root FROM replicator.capture_ancestors(p_table) a
        WHERE NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = a) LIMIT 1;
        IF p_table_id IS NOT NULL THEN
            RAISE EXCEPTION 'table % is captured (queue "%") and cannot be % % (statements naming % change its rows without firing its triggers): remove it from its queue (replicator table remove % %) and capture % instead, which includes its rows',
                p_table, p_queue_name, CASE WHEN v_partition THEN 'a partition of' ELSE 'an inheritance child of' END,
                v_parent, v_parent, p_queue_name, p_table, v_root;
        END IF;
        SELECT format('queue "%s"', q.queue_name) INTO v_owner
        FROM replicator.captured_table t JOIN replicator.queue q ON q.queue_id = t.queue_id
        WHERE t.table_oid IN (SELECT replicator.capture_ancestors(p_table)) AND t.table_oid <> p_table
        ORDER BY t.table_id LIMIT 1;
        IF v_owner IS NOT NULL THEN
            RAISE EXCEPTION 'table % % %, which % captures with its descendants: its rows are captured already, as rows of %',
                p_table, CASE WHEN v_partition THEN 'is a partition of' ELSE 'inherits from' END,
                v_parent, v_owner, v_root;
        END IF;
        RAISE EXCEPTION 'table % % % (statements naming % change its rows without firing its triggers): capture % instead, which includes its rows: replicator table add % %',
            p_table, CASE WHEN v_partition THEN 'is a partition of' ELSE 'inherits from' END,
            v_parent, v_parent, v_root, p_queue_name, v_root;
    END IF;

    -- The tree, walked once. Everything below is one query over it, whatever its size
    -- (every ALTER of a partition and every CREATE TABLE ... PARTITION OF comes here).
    v_tree := ARRAY(SELECT d FROM replicator.capture_tree(p_table) d WHERE d <> p_table);
    IF cardinality(v_tree) = 0 THEN
        RETURN;
    END IF;
    SELECT t.table_oid::regclass AS rel, q.queue_name INTO v_member
    FROM replicator.captured_table t JOIN replicator.queue q ON q.queue_id = t.queue_id
    WHERE t.table_oid = ANY (v_tree)
    ORDER BY t.table_oid, t.table_id LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'table % is captured on its own (queue "%") and cannot also be part of the capture of %, its ancestor: remove it first (replicator table remove % %)',
            v_member.rel, v_member.queue_name, p_table, v_member.queue_name, v_member.rel;
    END IF;
    -- A partition has one parent, in the tree, and its parent's NOT NULL columns: only
    -- its kind (a foreign table) or persistence can be refused, which its pg_class row
    -- tells; the queries of the other checks are for inheritance children only.
    FOR v_member IN
        SELECT c.oid::regclass AS rel, c.relkind, c.relpersistence, c.relispartition,
               (SELECT h.inhparent::regclass FROM pg_inherits h
                WHERE h.inhrelid = c.oid ORDER BY h.inhseqno LIMIT 1) AS parent,
               CASE WHEN NOT c.relispartition THEN
                   (SELECT h.inhparent::regclass FROM pg_inherits h
                    WHERE h.inhrelid = c.oid AND h.inhparent <> p_table AND h.inhparent <> ALL (v_tree)
                    ORDER BY h.inhseqno LIMIT 1) END AS outside,
               CASE WHEN NOT c.relispartition THEN
                   (SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum)
                    FROM pg_attribute a
                    JOIN pg_attribute r ON r.attrelid = p_table AND r.attname = a.attname AND r.attnotnull
                    WHERE a.attrelid = c.oid AND a.attname = ANY (p_key) AND NOT a.attnotnull
                      AND NOT a.attisdropped) END AS nullable_key
        FROM pg_class c
        WHERE c.oid = ANY (v_tree)
          AND (NOT c.relispartition OR c.relkind NOT IN ('r', 'p') OR c.relpersistence = 't')
        ORDER BY c.oid
    LOOP
        IF v_member.relkind NOT IN ('r', 'p') THEN
            RAISE EXCEPTION 'table % cannot be captured with its descendant %, which is not a plain table (a foreign table cannot carry capture triggers): detach it (%) or do not capture %',
                p_table, v_member.rel, replicator.detach_statement(v_member.rel, v_member.parent, v_member.relispartition),
                p_table;
        END IF;
        IF v_member.relpersistence = 't' THEN
            RAISE EXCEPTION 'table % cannot be captured with its descendant %, a temporary table (other sessions do not see its rows): detach it (%) or do not capture %',
                p_table, v_member.rel, replicator.detach_statement(v_member.rel, v_member.parent, v_member.relispartition),
                p_table;
        END IF;
        IF v_member.outside IS NOT NULL THEN
            RAISE EXCEPTION 'table % inherits from % as well as from % (statements naming % would change its rows without firing the triggers of %): remove that inheritance (ALTER TABLE % NO INHERIT %) or do not capture %',
                v_member.rel, v_member.outside, p_table, v_member.outside, p_table, v_member.rel, v_member.outside, p_table;
        END IF;
        IF v_member.nullable_key IS NOT NULL THEN
            RAISE EXCEPTION 'key column(s) % of % may be NULL in its descendant % (rows of a NULL key cannot be replicated by their key): make them NOT NULL there (ALTER TABLE % ALTER COLUMN ... SET NOT NULL)',
                v_member.nullable_key, p_table, v_member.rel, v_member.rel;
        END IF;
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION replicator.detach_statement(p_rel regclass, p_parent regclass, p_partition boolean)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
-- ----------------------------------------------------------------------
-- Function: replicator.detach_statement(p_rel, p_parent, p_partition)
--
--      The statement that takes a descendant out of its parent, for the
--      messages of replicator.check_capture_tree: PostgreSQL refuses NO
--      INHERIT on a partition.
--
-- Parameters:
--      p_rel       - the descendant
--      p_parent    - its parent
--      p_partition - whether it is a partition (pg_class.relispartition)
--
-- Returns:
--      'ALTER TABLE parent DETACH PARTITION rel' or
--      'ALTER TABLE rel NO INHERIT parent'
-- ----------------------------------------------------------------------
    SELECT CASE WHEN p_partition THEN format('ALTER TABLE %s DETACH PARTITION %s', p_parent, p_rel)
                ELSE format('ALTER TABLE %s NO INHERIT %s', p_rel, p_parent) END;
$$;

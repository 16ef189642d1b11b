def test_insert_is_queued_as_one_event_per_statement(conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "c")
    conn.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 3) g")
    source.tick("q", force=True)
    batch = source.next_batch("q", "c")
    events = list(source.batch_events(batch))
    assert [(e[3], e[5]) for e in events] == [("I", '[[1, "x"], [2, "x"], [3, "x"]]')]

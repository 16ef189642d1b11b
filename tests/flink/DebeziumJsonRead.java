// Reads change records with Flink's own `debezium-json` format (flink-json's
// DebeziumJsonDeserializationSchema, as a Flink SQL table `'format' = 'debezium-json'` reads a
// Kafka topic) and prints the changelog rows Flink makes of them, one a line: the row kind
// (+I, -U, +U, -D) and the fields as a JSON array. The record values come on stdin, one a line;
// the table's columns are the first argument, "name:TYPE,..." (TYPE: INT, BIGINT, STRING), the
// second says whether records carry their schema ("true": debezium-json.schema-include).
// A record Flink refuses ends the program with its message on stderr, exit status 1.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

import org.apache.flink.formats.common.TimestampFormat;
import org.apache.flink.formats.json.debezium.DebeziumJsonDeserializationSchema;
import org.apache.flink.table.api.DataTypes;
import org.apache.flink.table.data.RowData;
import org.apache.flink.table.runtime.typeutils.InternalTypeInfo;
import org.apache.flink.table.types.DataType;
import org.apache.flink.table.types.logical.LogicalType;
import org.apache.flink.table.types.logical.RowType;
import org.apache.flink.util.Collector;

public final class DebeziumJsonRead {
    public static void main(String[] args) throws Exception {
        List<DataTypes.Field> fields = new ArrayList<>();
        for (String column : args[0].split(",")) {
            String[] parts = column.split(":");
            DataType type = switch (parts[1]) {
                case "INT" -> DataTypes.INT();
                case "BIGINT" -> DataTypes.BIGINT();
                case "STRING" -> DataTypes.STRING();
                default -> throw new IllegalArgumentException("type " + parts[1]);
            };
            fields.add(DataTypes.FIELD(parts[0], type));
        }
        DataType row = DataTypes.ROW(fields.toArray(new DataTypes.Field[0]));
        RowType rowType = (RowType) row.getLogicalType();
        DebeziumJsonDeserializationSchema format = new DebeziumJsonDeserializationSchema(
                row, Collections.emptyList(), InternalTypeInfo.of(rowType), Boolean.parseBoolean(args[1]), false,
                TimestampFormat.ISO_8601);
        format.open(null);
        List<LogicalType> types = rowType.getChildren();
        StringBuilder out = new StringBuilder();
        Collector<RowData> print = new Collector<>() {
            @Override
            public void collect(RowData data) {
                out.append(data.getRowKind().shortString()).append('\t').append('[');
                for (int i = 0; i < types.size(); i++) {
                    Object value = RowData.createFieldGetter(types.get(i), i).getFieldOrNull(data);
                    out.append(i == 0 ? "" : ",");
                    if (value == null) {
                        out.append("null");
                    } else if (value instanceof Number) {
                        out.append(value);
                    } else {
                        out.append('"').append(value.toString().replace("\\", "\\\\").replace("\"", "\\\"")).append('"');
                    }
                }
                out.append("]\n");
            }

            @Override
            public void close() {
            }
        };
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            format.deserialize(line.getBytes(StandardCharsets.UTF_8), print);
        }
        System.out.print(out);
    }
}

package replicator.delta;

import io.delta.storage.S3SingleDriverLogStore;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.FileAlreadyExistsException;
import java.util.Iterator;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.s3a.RemoteFileChangedException;

/**
 * Delta's S3 log store, less its race: a new file (a commit) is one conditional PUT
 * (If-None-Match: *), which S3 refuses when the file exists, whoever wrote it (replicator's
 * consumer, another Spark). Delta takes the refusal for a conflict: it reads the new version
 * and commits after it, or gives up. S3SingleDriverLogStore checks that the file is absent,
 * then writes it: exclusive only of writers in its own JVM.
 */
public class ConditionalS3LogStore extends S3SingleDriverLogStore {
    /** Hadoop's conditional create (HADOOP-19256, S3A since 3.4.2); plain create(path, false) does not use it. */
    static final String CONDITIONAL = "fs.option.create.conditional.overwrite";

    public ConditionalS3LogStore(Configuration conf) {
        super(conf);
    }

    @Override
    public void write(Path path, Iterator<String> actions, Boolean overwrite, Configuration conf) throws IOException {
        if (overwrite) {
            super.write(path, actions, overwrite, conf);
            return;
        }
        ByteArrayOutputStream content = new ByteArrayOutputStream();   // whole before the PUT starts
        while (actions.hasNext()) {
            content.write((actions.next() + "\n").getBytes(StandardCharsets.UTF_8));
        }
        FSDataOutputStream out = (FSDataOutputStream) path.getFileSystem(conf).createFile(path)
                .overwrite(false).must(CONDITIONAL, true).build();
        try {
            content.writeTo(out);
        } catch (IOException | RuntimeException e) {
            out.abort();   // nothing uploaded: close() would PUT what was written so far
            throw e;
        }
        try {
            out.close();   // the PUT
        } catch (RemoteFileChangedException | org.apache.hadoop.fs.FileAlreadyExistsException e) {
            // 412 Precondition Failed: another writer's file is there
            throw (FileAlreadyExistsException) new FileAlreadyExistsException(path.toString()).initCause(e);
        }
    }
}

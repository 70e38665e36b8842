// Apache Avro's own Java decoder reads rlstream's single-object records (tests/timetravel).
// Usage: java -cp <avro jars> DecodeEvents.java READER.avsc WRITER.avsc RECORD.bin FIELD...
// Prints FIELD=value per line (the datum resolved from the writer to the reader schema; <absent>
// for a field the reader does not have), then
// fingerprint_ok=true|false: whether the record's header holds the writer schema's
// CRC-64-AVRO fingerprint as the Avro spec lays it out (little-endian).
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.DecoderFactory;

public class DecodeEvents {
    public static void main(String[] args) throws Exception {
        Schema reader = new Schema.Parser().parse(Files.readString(Path.of(args[0])));
        Schema writer = new Schema.Parser().parse(Files.readString(Path.of(args[1])));
        byte[] data = Files.readAllBytes(Path.of(args[2]));
        if ((data[0] & 0xff) != 0xc3 || data[1] != 0x01) throw new IllegalArgumentException("not single-object encoded");
        long header = ByteBuffer.wrap(data, 2, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
        GenericDatumReader<GenericRecord> datumReader = new GenericDatumReader<>(writer, reader);
        GenericRecord record = datumReader.read(null, DecoderFactory.get().binaryDecoder(data, 10, data.length - 10, null));
        for (int i = 3; i < args.length; i++) {
            boolean known = record.getSchema().getField(args[i]) != null;
            System.out.println(args[i] + "=" + (known ? record.get(args[i]) : "<absent>"));
        }
        System.out.println("fingerprint_ok=" + (header == SchemaNormalization.parsingFingerprint64(writer)));
    }
}

// Apache Avro (Java) side of the interoperability test: reads and writes Avro single-object
// encoding with org.apache.avro.message.BinaryMessageDecoder/BinaryMessageEncoder.
//
//   java AvroInterop <avsc dir> decode <dir>   each <Name>.bin -> <Name>.json (Avro JSON datum)
//   java AvroInterop <avsc dir> encode <dir>   each <Name>.json (Avro JSON datum) -> <Name>.bin
//
// <Name> is a record's full name (rlstream.SampleBatch). A decoder knows only that record's
// schema, so it resolves a message only if the header carries the spec's fingerprint.
import java.io.ByteArrayOutputStream;
import java.io.File;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.avro.Schema;
import org.apache.avro.AvroRuntimeException;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericDatumWriter;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.DecoderFactory;
import org.apache.avro.io.EncoderFactory;
import org.apache.avro.io.JsonEncoder;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;

public class AvroInterop {
  /** Every named type in the .avsc files (of a versioned record, its newest version
   *  ``Name.vN.avsc``: the one rlstream writes), parsed in dependency order. */
  static Map<String, Schema> load(File dir) throws Exception {
    Map<String, Schema> known = new HashMap<>();
    Map<String, File> newest = new HashMap<>();
    Map<String, Integer> newestVersion = new HashMap<>();
    for (File f : dir.listFiles()) {
      java.util.regex.Matcher m =
          java.util.regex.Pattern.compile("(.+?)(?:\\.v(\\d+))?\\.avsc").matcher(f.getName());
      if (!m.matches()) continue;
      int version = m.group(2) == null ? 0 : Integer.parseInt(m.group(2));
      if (version >= newestVersion.getOrDefault(m.group(1), -1)) {
        newestVersion.put(m.group(1), version);
        newest.put(m.group(1), f);
      }
    }
    List<File> left = new ArrayList<>(newest.values());
    while (!left.isEmpty()) {
      int before = left.size();
      for (File f : new ArrayList<>(left)) {
        Schema.Parser parser = new Schema.Parser();
        parser.addTypes(known.values());
        try {
          Schema s = parser.parse(f);
          known.put(s.getFullName(), s);
          left.remove(f);
        } catch (AvroRuntimeException e) {
          // refers to a type not parsed yet: next round
        }
      }
      if (left.size() == before) throw new IllegalStateException("unresolvable schemas: " + left);
    }
    return known;
  }

  public static void main(String[] args) throws Exception {
    Map<String, Schema> schemas = load(new File(args[0]));
    String mode = args[1];
    File dir = new File(args[2]);
    String in = mode.equals("decode") ? ".bin" : ".json";
    for (File f : dir.listFiles()) {
      if (!f.getName().endsWith(in)) continue;
      String name = f.getName().substring(0, f.getName().length() - in.length());
      Schema schema = schemas.get(name);
      if (schema == null) throw new IllegalArgumentException("no schema " + name);
      byte[] data = Files.readAllBytes(f.toPath());
      if (mode.equals("decode")) {
        BinaryMessageDecoder<GenericRecord> decoder = new BinaryMessageDecoder<>(GenericData.get(), schema);
        GenericRecord record = decoder.decode(data);
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        JsonEncoder enc = EncoderFactory.get().jsonEncoder(schema, out);
        new GenericDatumWriter<GenericRecord>(schema).write(record, enc);
        enc.flush();
        Files.write(new File(dir, name + ".json").toPath(), out.toByteArray());
      } else {
        GenericRecord record = new GenericDatumReader<GenericRecord>(schema).read(
            null, DecoderFactory.get().jsonDecoder(schema, new String(data, StandardCharsets.UTF_8)));
        ByteBuffer buf = new BinaryMessageEncoder<GenericRecord>(GenericData.get(), schema).encode(record);
        byte[] bytes = new byte[buf.remaining()];
        buf.get(bytes);
        Files.write(new File(dir, name + ".bin").toPath(), bytes);
      }
      System.out.println(mode + " " + name + " ok");
    }
  }
}

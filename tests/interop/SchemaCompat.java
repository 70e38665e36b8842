// Apache Avro (Java) side of the schema compatibility gate: org.apache.avro.SchemaCompatibility's
// verdict on whether a reader schema can read what a writer schema wrote.
//
//   java SchemaCompat <dir>   for each <id>.reader.avsc with its <id>.writer.avsc (standalone
//                             schemas), one line: "<id> COMPATIBLE" or
//                             "<id> INCOMPATIBLE <type> at <location>: <message>[ | ...]"
import java.io.File;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

import org.apache.avro.Schema;
import org.apache.avro.SchemaCompatibility;
import org.apache.avro.SchemaCompatibility.Incompatibility;
import org.apache.avro.SchemaCompatibility.SchemaCompatibilityResult;
import org.apache.avro.SchemaCompatibility.SchemaCompatibilityType;

public class SchemaCompat {
  public static void main(String[] args) throws Exception {
    File dir = new File(args[0]);
    File[] readers = dir.listFiles((d, n) -> n.endsWith(".reader.avsc"));
    Arrays.sort(readers);
    for (File r : readers) {
      String id = r.getName().substring(0, r.getName().length() - ".reader.avsc".length());
      Schema reader = new Schema.Parser().parse(r);
      Schema writer = new Schema.Parser().parse(new File(dir, id + ".writer.avsc"));
      SchemaCompatibilityResult res =
          SchemaCompatibility.checkReaderWriterCompatibility(reader, writer).getResult();
      if (res.getCompatibility() == SchemaCompatibilityType.COMPATIBLE) {
        System.out.println(id + " COMPATIBLE");
        continue;
      }
      List<String> why = new ArrayList<>();
      for (Incompatibility i : res.getIncompatibilities()) {
        why.add(i.getType() + " at " + i.getLocation() + ": " + i.getMessage().replace('\n', ' '));
      }
      System.out.println(id + " INCOMPATIBLE " + String.join(" | ", why));
    }
  }
}

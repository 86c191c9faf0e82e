use super::*;

#[test]
fn lines_are_reassembled_across_chunks() {
    let mut got = Vec::new();
    let mut lines = Lines::default();
    for chunk in [&b"{\"a\""[..], b":1}\n{\"b\":2}\n{", b"}", b"\n"] {
        lines
            .feed(chunk, |doc| {
                got.push(doc.to_owned());
                Ok(())
            })
            .unwrap();
    }
    lines.finish().unwrap();
    assert_eq!(got, ["{\"a\":1}", "{\"b\":2}", "{}"]);
    let mut lines = Lines::default();
    lines.feed(b"{\"a\"", |_| Ok(())).unwrap();
    assert!(lines.finish().is_err());
}

#[test]
fn chunks_split_anywhere_and_join_back() {
    let docs: Vec<String> = (0..3000)
        .map(|i| format!("{{\"n\":{i},\"pad\":\"{}\"}}", "x".repeat(i % 700)))
        .collect();
    let mut chunker = Chunker::default();
    let mut chunks = Vec::new();
    for d in &docs {
        chunks.extend(chunker.push(d.as_bytes()));
    }
    chunks.push(chunker.finish());
    assert!(chunks.len() > 1);
    assert!(chunks.iter().all(|c| c.len() <= super::super::CHUNK_BYTES));
    let mut got = Vec::new();
    let mut lines = Lines::default();
    for c in &chunks {
        lines
            .feed(c, |doc| {
                got.push(doc.to_owned());
                Ok(())
            })
            .unwrap();
    }
    lines.finish().unwrap();
    assert_eq!(got, docs);
}

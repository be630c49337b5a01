//! The admission of a GraphQL document, before async-graphql looks at it.
//!
//! async-graphql's own parse step checks the document's nesting by walking
//! every fragment wherever it is spread, without remembering what it found,
//! so a kilobyte of fragments that spread the next one twice costs it
//! 2^levels steps; its validation walks the expanded document too. Both run
//! before any extension can count. So every document, from any transport,
//! is admitted here first, in time linear in its length:
//!
//! 1. its text is scanned once (`scan`): its length, its bracket nesting
//!    (which also bounds the parser's recursion), and how many fragments and
//!    spreads it writes;
//! 2. it is parsed;
//! 3. its syntax tree is walked once, each fragment measured once however
//!    often it is spread (`Expanded`): the selections, aliases and nesting
//!    of the document as it would execute, and fragment cycles.
//!
//! A document that passes has at most `max_nodes` selections once expanded,
//! which bounds async-graphql's later walks. The parsed document is handed
//! to the request (`Request::set_parsed_query`), so it is parsed once.
//!
//! Where it runs: a short document is admitted where it arrives; a longer
//! one (more than `INLINE_BYTES`), and the validation of one that expands
//! past `INLINE_NODES`, run on the blocking pool, one at a time per
//! `DocumentAdmission`, waiting at most the budget for their turn. So no document
//! holds one of the runtime's worker threads, which the API's other
//! requests, the probes and the workers' leases share, for longer than a
//! short document's parse.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextPrepareRequest, NextValidation,
};
use async_graphql::parser::types::{ExecutableDocument, OperationType, Selection, SelectionSet};
use async_graphql::{Name, Request, ServerError, ServerResult, ValidationResult};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::auth::Viewer;
use super::counts::{Counts, Held};
use super::error::{as_bad_request, bad_request};
use crate::config::ApiConfig;

/// Documents up to this length are admitted on the task that received them:
/// their scan, parse and walk take microseconds.
pub const INLINE_BYTES: usize = 8 * 1024;

/// Documents that expand to more selections than this are validated on the
/// blocking pool.
pub const INLINE_NODES: usize = 2_000;

/// Arguments one field may be given; no field of the schema takes more
/// than a few.
pub const MAX_ARGUMENTS: usize = 32;

/// What a document may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DocumentLimits {
    /// Its length in bytes.
    pub max_bytes: usize,
    /// Brackets (`{`, `[`, `(`) open at once in its text, and selection sets
    /// nested once fragments are expanded (each field with a selection, each
    /// fragment and inline fragment, one level).
    pub max_nesting: usize,
    /// Fragment definitions.
    pub max_fragments: usize,
    /// Spreads (`...`, fragment spreads and inline fragments) in its text.
    pub max_spreads: usize,
    /// Selections (fields, spreads, inline fragments) once expanded.
    pub max_nodes: usize,
    /// Aliases once expanded.
    pub max_aliases: usize,
}

impl DocumentLimits {
    pub fn of(api: &ApiConfig) -> DocumentLimits {
        DocumentLimits {
            max_bytes: api.max_document_bytes,
            max_nesting: api.max_document_nesting,
            max_fragments: api.max_fragments,
            max_spreads: api.max_spreads,
            max_nodes: api.max_query_nodes,
            max_aliases: api.max_aliases,
        }
    }
}

/// Why a document was refused. Each names the limit it passed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error("the document is longer than {0} bytes")]
    TooLong(usize),
    #[error("the document nests deeper than {0} levels")]
    TooDeep(usize),
    #[error("the document defines more than {0} fragments")]
    TooManyFragments(usize),
    #[error("the document writes more than {0} spreads")]
    TooManySpreads(usize),
    #[error("the query selects more than {0} fields once its fragments are expanded")]
    TooManyNodes(usize),
    #[error("the query uses more than {0} aliases")]
    TooManyAliases(usize),
    #[error("a field takes at most {0} arguments")]
    TooManyArguments(usize),
    #[error("fragment \"{0}\" spreads itself")]
    Cycle(String),
    #[error("the server is admitting other long documents; try again")]
    Busy,
    #[error(
        "a long document of yours is being admitted already; send the next once it is answered"
    )]
    YoursBusy,
    /// The parser's own error, with its location, as async-graphql would
    /// have given it.
    #[error("{}", .0.message)]
    Syntax(Box<ServerError>),
}

impl From<Refusal> for ServerError {
    fn from(refusal: Refusal) -> ServerError {
        match refusal {
            Refusal::Syntax(err) => as_bad_request(*err),
            other => bad_request(other.to_string()),
        }
    }
}

/// Admits `query`: scanned, parsed and measured, or refused.
pub fn parse(query: &str, limits: &DocumentLimits) -> Result<Admitted, Refusal> {
    scan(query, limits)?;
    let document = async_graphql::parser::parse_query(query)
        .map_err(|err| Refusal::Syntax(Box::new(err.into())))?;
    let expanded = Expanded::of(&document, limits)?;
    Ok(Admitted { document, expanded })
}

/// A document that passed, with what it expands to.
pub struct Admitted {
    pub document: ExecutableDocument,
    pub expanded: Expanded,
}

/// The one pass over the text. Strings and comments are skipped, so their
/// brackets and dots count for nothing.
fn scan(query: &str, limits: &DocumentLimits) -> Result<(), Refusal> {
    if query.len() > limits.max_bytes {
        return Err(Refusal::TooLong(limits.max_bytes));
    }
    let text = query.as_bytes();
    let (mut at, mut depth, mut fragments, mut spreads) = (0, 0usize, 0usize, 0usize);
    while let Some(&byte) = text.get(at) {
        at += 1;
        match byte {
            b'#' => {
                while text.get(at).is_some_and(|b| *b != b'\n' && *b != b'\r') {
                    at += 1;
                }
            }
            b'"' if text.get(at..at + 2) == Some(b"\"\"") => {
                at += 2;
                // A block string ends at the first `"""` not escaped as `\"""`.
                while at < text.len() && text.get(at..at + 3) != Some(b"\"\"\"") {
                    at += if text.get(at..at + 4) == Some(b"\\\"\"\"") {
                        4
                    } else {
                        1
                    };
                }
                at += 3;
            }
            b'"' => {
                while let Some(&b) = text.get(at) {
                    at += 1;
                    match b {
                        b'\\' => at += 1,
                        b'"' | b'\n' | b'\r' => break,
                        _ => {}
                    }
                }
            }
            b'{' | b'[' | b'(' => {
                depth += 1;
                if depth > limits.max_nesting {
                    return Err(Refusal::TooDeep(limits.max_nesting));
                }
            }
            b'}' | b']' | b')' => depth = depth.saturating_sub(1),
            b'.' if text.get(at..at + 2) == Some(b"..") => {
                at += 2;
                spreads += 1;
                if spreads > limits.max_spreads {
                    return Err(Refusal::TooManySpreads(limits.max_spreads));
                }
            }
            b'_' | b'a'..=b'z' | b'A'..=b'Z' => {
                let start = at - 1;
                while text
                    .get(at)
                    .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
                {
                    at += 1;
                }
                if depth == 0 && &text[start..at] == b"fragment" {
                    fragments += 1;
                    if fragments > limits.max_fragments {
                        return Err(Refusal::TooManyFragments(limits.max_fragments));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A selection set as it would execute, its fragments expanded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expanded {
    /// Fields, spreads and inline fragments.
    pub nodes: usize,
    pub aliases: usize,
    /// Selection sets nested below this one, counted as async-graphql's
    /// parse-time check counts them.
    pub nesting: usize,
}

impl Expanded {
    /// The whole document: every operation, each fragment measured once.
    /// Counts saturate, so a fragment that doubles at every level is
    /// refused rather than counted for ever.
    pub fn of(document: &ExecutableDocument, limits: &DocumentLimits) -> Result<Expanded, Refusal> {
        let mut walk = Walk {
            document,
            fragments: HashMap::new(),
        };
        let mut total = Expanded::default();
        for (_, operation) in document.operations.iter() {
            let size = walk.selections(&operation.node.selection_set.node)?;
            total = Expanded {
                nodes: total.nodes.saturating_add(size.nodes),
                aliases: total.aliases.saturating_add(size.aliases),
                nesting: total.nesting.max(size.nesting),
            };
        }
        // Validation walks every fragment definition as well, used or not,
        // each expanded: their sizes count too (an unused one is refused by
        // validation only after that walk).
        for name in document.fragments.keys() {
            if let Some(size) = walk.fragment(name)? {
                total.nodes = total.nodes.saturating_add(size.nodes);
            }
        }
        if total.nesting > limits.max_nesting {
            return Err(Refusal::TooDeep(limits.max_nesting));
        }
        if total.aliases > limits.max_aliases {
            return Err(Refusal::TooManyAliases(limits.max_aliases));
        }
        if total.nodes > limits.max_nodes {
            return Err(Refusal::TooManyNodes(limits.max_nodes));
        }
        Ok(total)
    }

    fn beside(self, other: Expanded) -> Expanded {
        Expanded {
            nodes: self.nodes.saturating_add(other.nodes),
            aliases: self.aliases.saturating_add(other.aliases),
            nesting: self.nesting.max(other.nesting),
        }
    }

    /// This set as one selection's children: one level deeper.
    fn below(self, node: Expanded) -> Expanded {
        Expanded {
            nodes: node.nodes.saturating_add(self.nodes),
            aliases: node.aliases.saturating_add(self.aliases),
            nesting: self.nesting.saturating_add(1),
        }
    }
}

struct Walk<'a> {
    document: &'a ExecutableDocument,
    /// Each fragment's size once known; `None` while it is being walked.
    fragments: HashMap<&'a Name, Option<Expanded>>,
}

impl<'a> Walk<'a> {
    fn selections(&mut self, set: &'a SelectionSet) -> Result<Expanded, Refusal> {
        let one = Expanded {
            nodes: 1,
            ..Expanded::default()
        };
        let mut size = Expanded::default();
        for item in &set.items {
            let inner = match &item.node {
                Selection::Field(field) => {
                    let field = &field.node;
                    // Validation compares the arguments of fields of one
                    // name pairwise, each by a linear search: few a field.
                    if field.arguments.len() > MAX_ARGUMENTS {
                        return Err(Refusal::TooManyArguments(MAX_ARGUMENTS));
                    }
                    let node = Expanded {
                        nodes: 1 + field.arguments.len(),
                        aliases: usize::from(field.alias.is_some()),
                        ..one
                    };
                    if field.selection_set.node.items.is_empty() {
                        node
                    } else {
                        self.selections(&field.selection_set.node)?.below(node)
                    }
                }
                Selection::InlineFragment(fragment) => self
                    .selections(&fragment.node.selection_set.node)?
                    .below(one),
                Selection::FragmentSpread(spread) => {
                    match self.fragment(&spread.node.fragment_name.node)? {
                        Some(fragment) => fragment.below(one),
                        None => one,
                    }
                }
            };
            size = size.beside(inner);
        }
        Ok(size)
    }

    /// A fragment's size; `None` for one the document does not define (which
    /// validation refuses).
    fn fragment(&mut self, name: &'a Name) -> Result<Option<Expanded>, Refusal> {
        match self.fragments.get(name) {
            Some(Some(known)) => return Ok(Some(*known)),
            Some(None) => return Err(Refusal::Cycle(name.to_string())),
            None => {}
        }
        let Some(definition) = self.document.fragments.get(name) else {
            return Ok(None);
        };
        self.fragments.insert(name, None);
        let size = self.selections(&definition.node.selection_set.node)?;
        self.fragments.insert(name, Some(size));
        Ok(Some(size))
    }
}

/// Where documents are admitted: the limits, and the turn that long
/// documents wait for.
pub struct DocumentAdmission {
    limits: DocumentLimits,
    /// At most this many long documents are parsed or validated at once.
    long_work: Arc<Semaphore>,
    /// Long documents of one principal waiting for a turn or taking one:
    /// one, so that principals take turns in the order they ask (the wait
    /// is first come, first served) and one principal's stream of long
    /// documents cannot keep another's waiting past the budget.
    long_per_principal: Arc<Counts<(String, String)>>,
    /// How long a long document waits for its turn before it is refused.
    budget: Duration,
}

impl DocumentAdmission {
    pub fn new(api: &ApiConfig) -> Arc<DocumentAdmission> {
        Arc::new(DocumentAdmission {
            limits: DocumentLimits::of(api),
            long_work: Arc::new(Semaphore::new(1)),
            long_per_principal: Counts::new(1),
            budget: Duration::from_millis(api.admission_budget_ms),
        })
    }

    pub fn limits(&self) -> &DocumentLimits {
        &self.limits
    }

    /// Admits `request`'s document where it arrived, if it is short;
    /// `None` for a long one, which `admit` takes to the blocking pool.
    pub fn admit_inline(&self, request: &mut Request) -> Option<Result<Expanded, Refusal>> {
        if is_admitted(request) {
            return None;
        }
        if request.query.len() > INLINE_BYTES {
            return None;
        }
        Some(parse(&request.query, &self.limits).map(|admitted| mark(request, admitted)))
    }

    /// Admits `request`'s document (once: a request already admitted
    /// passes), sent by `caller`.
    pub async fn admit(
        &self,
        request: &mut Request,
        caller: Option<&Viewer>,
    ) -> Result<Option<Expanded>, Refusal> {
        if is_admitted(request) {
            return Ok(None);
        }
        if let Some(inline) = self.admit_inline(request) {
            return inline.map(Some);
        }
        let query = request.query.clone();
        let limits = self.limits;
        let admitted = self
            .on_the_blocking_pool(caller, move || parse(&query, &limits))
            .await??;
        Ok(Some(mark(request, admitted)))
    }

    /// The caller's one long document at a time; refused at once when it
    /// has one waiting or admitted already.
    fn caller_turn(
        &self,
        caller: Option<&Viewer>,
    ) -> Result<Option<Held<(String, String)>>, Refusal> {
        caller
            .map(|viewer| {
                self.long_per_principal
                    .take((viewer.tenant.clone(), viewer.principal.clone()))
                    .ok_or(Refusal::YoursBusy)
            })
            .transpose()
    }

    /// Waits, within the budget, for a turn at long work, the caller's own
    /// first.
    async fn long_turn(
        &self,
        caller: Option<&Viewer>,
    ) -> Result<(Option<Held<(String, String)>>, OwnedSemaphorePermit), Refusal> {
        let mine = self.caller_turn(caller)?;
        let turn = tokio::time::timeout(self.budget, self.long_work.clone().acquire_owned())
            .await
            .map_err(|_| Refusal::Busy)?
            .map_err(|_| Refusal::Busy)?;
        Ok((mine, turn))
    }

    /// Runs `work` on the blocking pool when its turn comes within the
    /// budget.
    async fn on_the_blocking_pool<T: Send + 'static>(
        &self,
        caller: Option<&Viewer>,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Refusal> {
        let turn = self.long_turn(caller).await?;
        let done = tokio::task::spawn_blocking(move || {
            let result = work();
            drop(turn);
            result
        });
        done.await.map_err(|_| Refusal::Busy)
    }

    /// The extension that admits every request the schema executes.
    pub fn extension(self: &Arc<DocumentAdmission>) -> AdmissionExtension {
        AdmissionExtension(self.clone())
    }
}

/// What an admitted request's document expands to; `None` for a request
/// not admitted yet. Its presence marks the request admitted, so that a
/// transport that admits before it executes is not admitted twice.
fn admitted(request: &Request) -> Option<Expanded> {
    request
        .data
        .get(&TypeId::of::<Expanded>())
        .and_then(|expanded| expanded.downcast_ref::<Expanded>())
        .copied()
}

fn is_admitted(request: &Request) -> bool {
    admitted(request).is_some()
}

fn mark(request: &mut Request, admitted: Admitted) -> Expanded {
    request.set_parsed_query(admitted.document);
    request.data.insert(admitted.expanded);
    admitted.expanded
}

/// Admits each request before anything else of the schema sees it, and
/// validates a document that expands past `INLINE_NODES` off the runtime's
/// worker threads. Registered first, so that it runs first.
pub struct AdmissionExtension(Arc<DocumentAdmission>);

impl ExtensionFactory for AdmissionExtension {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(RequestAdmission {
            admission: self.0.clone(),
            nodes: AtomicUsize::new(0),
        })
    }
}

struct RequestAdmission {
    admission: Arc<DocumentAdmission>,
    /// The admitted document's selections once expanded.
    nodes: AtomicUsize,
}

#[async_trait::async_trait]
impl Extension for RequestAdmission {
    async fn prepare_request(
        &self,
        ctx: &ExtensionContext<'_>,
        mut request: Request,
        next: NextPrepareRequest<'_>,
    ) -> ServerResult<Request> {
        let caller = Viewer::of_request(&request, ctx).cloned();
        self.admission.admit(&mut request, caller.as_ref()).await?;
        if let Some(expanded) = admitted(&request) {
            // A long document is validated off the runtime too, whatever
            // it expands to.
            let nodes = match request.query.len() > INLINE_BYTES {
                true => usize::MAX,
                false => expanded.nodes,
            };
            self.nodes.store(nodes, Ordering::Relaxed);
        }
        next.run(ctx, request).await
    }

    async fn validation(
        &self,
        ctx: &ExtensionContext<'_>,
        next: NextValidation<'_>,
    ) -> Result<ValidationResult, Vec<ServerError>> {
        let large = self.nodes.load(Ordering::Relaxed) > INLINE_NODES;
        let multi_thread = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread;
        if !(large && multi_thread) {
            return next.run(ctx).await;
        }
        // The validation borrows the schema and the document, so it cannot
        // move to the blocking pool; `block_in_place` hands this worker
        // thread's other tasks to another thread while it runs instead.
        let _turn = self
            .admission
            .long_turn(ctx.data_opt::<Viewer>())
            .await
            .map_err(|refused| vec![refused.into()])?;
        tokio::task::block_in_place(|| futures_util::FutureExt::now_or_never(next.run(ctx)))
            .unwrap_or_else(|| Err(vec![Refusal::Busy.into()]))
    }
}

/// The type of the operation a request would run; `None` when it does not
/// parse or names no operation it has (the executor refuses those).
pub fn operation_type(request: &mut Request) -> Option<OperationType> {
    let name = request.operation_name.clone();
    operation_of(request.parsed_query().ok()?, name.as_deref())
}

/// The type of the operation `name` (or the only one) of a document.
pub fn operation_of(document: &ExecutableDocument, name: Option<&str>) -> Option<OperationType> {
    document
        .operations
        .iter()
        .find(|(op_name, _)| match name {
            Some(name) => op_name.is_some_and(|n| n.as_str() == name),
            None => true,
        })
        .map(|(_, op)| op.node.ty)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> DocumentLimits {
        DocumentLimits {
            max_bytes: 256 * 1024,
            max_nesting: 32,
            max_fragments: 500,
            max_spreads: 2_000,
            max_nodes: 50_000,
            max_aliases: 50,
        }
    }

    /// One principal has one long document waiting or admitted at a time;
    /// another principal's goes meanwhile, so that a stream of one
    /// principal's long documents cannot keep anyone else's past the budget.
    #[tokio::test]
    async fn a_principal_has_one_long_document_admitted_at_a_time() {
        let admission = DocumentAdmission::new(&ApiConfig::default());
        let (ada, bob) = (Viewer::of("acme", "ada"), Viewer::of("acme", "bob"));
        let long = format!("{{ __typename }}\n#{}", "x".repeat(INLINE_BYTES));
        let admit = |viewer: &Viewer| {
            let mut request = Request::new(long.clone());
            let admission = admission.clone();
            let viewer = viewer.clone();
            async move { admission.admit(&mut request, Some(&viewer)).await }
        };
        // As while Ada's first long document waits for its turn, or is
        // parsed.
        let first = admission.caller_turn(Some(&ada)).unwrap();
        assert!(matches!(admit(&ada).await, Err(Refusal::YoursBusy)));
        assert!(admit(&bob).await.unwrap().is_some(), "Bob's goes meanwhile");
        drop(first);
        assert!(
            admit(&ada).await.unwrap().is_some(),
            "Ada's next goes after"
        );
    }

    /// `{ ...F0 }` and fragments each spreading the next one twice.
    fn doubling(levels: usize) -> String {
        let mut query = format!("{{ ...F0 }} fragment F{levels} on Query {{ a }}");
        for level in 0..levels {
            query.push_str(&format!(
                " fragment F{level} on Query {{ ...F{next} ...F{next} }}",
                next = level + 1
            ));
        }
        query
    }

    #[test]
    fn a_document_that_doubles_at_every_level_is_refused_by_its_expanded_size() {
        let started = std::time::Instant::now();
        let refused = parse(&doubling(29), &limits()).err();
        assert_eq!(refused, Some(Refusal::TooManyNodes(50_000)));
        assert!(started.elapsed() < Duration::from_secs(1));
        let admitted = parse(&doubling(10), &limits()).expect("1,024 fields pass");
        // 1,024 fields and 2,047 spreads from the operation, and each
        // fragment's own expansion (3 × 2^(10-k) - 2 for F_k), which
        // validation walks too.
        let fragments: usize = (0..=10).map(|k| 3 * (1 << (10 - k)) - 2).sum();
        assert_eq!(admitted.expanded.nodes, 1024 + 2047 + fragments);
        assert_eq!(admitted.expanded.nesting, 11);
    }

    #[test]
    fn nesting_counts_fragments_and_inline_fragments_as_async_graphql_does() {
        let query = "{ a { b { ...F } } } fragment F on B { ... on B { c { d } } }";
        let admitted = parse(query, &limits()).unwrap();
        // a, b, F, the inline fragment, c: five sets below the root.
        assert_eq!(admitted.expanded.nesting, 5);
        let strict = DocumentLimits {
            max_nesting: 4,
            ..limits()
        };
        assert_eq!(parse(query, &strict).err(), Some(Refusal::TooDeep(4)));
    }

    #[test]
    fn the_text_is_refused_on_length_brackets_fragments_and_spreads() {
        let small = DocumentLimits {
            max_bytes: 64,
            max_nesting: 3,
            max_fragments: 1,
            max_spreads: 2,
            ..limits()
        };
        assert_eq!(
            parse(&format!("{{ a }}{}", " ".repeat(64)), &small).err(),
            Some(Refusal::TooLong(64))
        );
        assert_eq!(
            parse("{ a(x: [[1]]) }", &small).err(),
            Some(Refusal::TooDeep(3))
        );
        assert_eq!(
            parse("{ a } fragment A on Q { a } fragment B on Q { a }", &small).err(),
            Some(Refusal::TooManyFragments(1))
        );
        assert_eq!(
            parse("{ ...A ...A ...A }", &small).err(),
            Some(Refusal::TooManySpreads(2))
        );
    }

    #[test]
    fn brackets_and_dots_in_strings_and_comments_count_for_nothing() {
        let small = DocumentLimits {
            max_nesting: 2,
            max_spreads: 0,
            max_fragments: 0,
            ..limits()
        };
        let query = "# {{{ ... fragment\n{ a(x: \"{{{ ... \\\" {{\", y: \"\"\"{{{ \\\"\"\" ...\n fragment \"\"\") }";
        assert!(
            parse(query, &small).is_ok(),
            "{:?}",
            parse(query, &small).err()
        );
    }

    #[test]
    fn unused_fragments_count_and_arguments_are_few() {
        let strict = DocumentLimits {
            max_nodes: 100,
            ..limits()
        };
        // Nothing spreads U, but validation walks it expanded all the same.
        let mut query = String::from("{ a } fragment U on Q { ...H ...H ...H }");
        query.push_str(" fragment H on Q {");
        for i in 0..40 {
            query.push_str(&format!(" f{i}"));
        }
        query.push('}');
        assert_eq!(
            parse(&query, &strict).err(),
            Some(Refusal::TooManyNodes(100))
        );
        let arguments: Vec<String> = (0..=MAX_ARGUMENTS).map(|i| format!("a{i}: 0")).collect();
        let query = format!("{{ me({}) }}", arguments.join(", "));
        assert_eq!(
            parse(&query, &limits()).err(),
            Some(Refusal::TooManyArguments(MAX_ARGUMENTS))
        );
    }

    #[test]
    fn a_fragment_cycle_is_refused_before_anything_walks_it() {
        let query = "{ ...A } fragment A on Q { ...B ...B } fragment B on Q { ...A ...A }";
        assert_eq!(
            parse(query, &limits()).err(),
            Some(Refusal::Cycle("A".to_owned()))
        );
    }

    #[test]
    fn aliases_are_counted_where_fragments_are_spread() {
        let strict = DocumentLimits {
            max_aliases: 3,
            ..limits()
        };
        assert!(parse("{ a: x b: x c: x }", &strict).is_ok());
        assert_eq!(
            parse("{ ...F ...F } fragment F on Q { a: x b: x }", &strict).err(),
            Some(Refusal::TooManyAliases(3))
        );
    }

    #[test]
    fn a_syntax_error_is_the_parser_s_own() {
        let Err(Refusal::Syntax(err)) = parse("{ a ", &limits()) else {
            panic!("a syntax error");
        };
        let expected = ServerError::from(async_graphql::parser::parse_query("{ a ").unwrap_err());
        assert_eq!(*err, expected);
        assert!(!err.locations.is_empty());
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        proptest! {
            /// Whatever the fragments spread, admission measures a document
            /// in one pass: nested fragment documents up to the size limit
            /// are admitted or refused well within the budget.
            #[test]
            fn nested_fragment_documents_are_measured_within_the_budget(
                spreads in proptest::collection::vec(
                    proptest::collection::vec(0usize..40, 0..6), 1..40),
                inline in proptest::collection::vec(any::<bool>(), 40),
            ) {
                let levels = spreads.len();
                let mut query = String::from("{ ...F0 }");
                for (level, targets) in spreads.iter().enumerate() {
                    query.push_str(&format!(" fragment F{level} on Query {{ a "));
                    for target in targets {
                        // Spreads point down only, so there is no cycle.
                        let to = level + 1 + target % (levels - level);
                        if to < levels {
                            if inline[to] {
                                query.push_str(&format!("... on Query {{ ...F{to} }} "));
                            } else {
                                query.push_str(&format!("...F{to} "));
                            }
                        }
                    }
                    query.push('}');
                }
                let started = std::time::Instant::now();
                let _ = parse(&query, &limits());
                prop_assert!(started.elapsed() < Duration::from_millis(50));
            }
        }
    }
}

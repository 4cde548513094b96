// Sphinx 9's Chinese search data assigns `window.Stemmer = ChineseStemmer` but ships only the English stemmer
// (sphinx/search/zh.py: language_name "Chinese", js_stemmer_rawcode "english-stemmer.js"), so every Chinese page
// threw "ChineseStemmer is not defined". Chinese terms are cut by jieba, not stemmed: the English stemmer serves
// the Latin words between them, as Sphinx intends. Loaded before language_data.js, on every page (a no-op in English).
var ChineseStemmer = function () {
  this.stemWord = (word) => (typeof EnglishStemmer === "function" ? new EnglishStemmer().stemWord(word) : word);
};
